"""Seeded orders computed per index, so no rank ever stores a permutation of the corpus.

`SeededPermutation` is a bijection of [0, n) keyed by (seed, source, epoch): a balanced
Feistel network over the smallest even number of bits that covers n, with cycle walking
(an output >= n is encrypted again until it lands inside; as the permutation's cycles all
pass through [0, n), this ends, after fewer than 4 rounds on average since the domain is
< 4n). Any slice of an epoch costs O(slice) time and O(1) memory, whatever n is, where
`numpy.random.permutation(n)` needs 8n bytes (500 MiB per rank for 2^31 tokens at
seq_len 32). How well it shuffles is measured in docs/data.md.

`MixtureSchedule` decides which source each global sample comes from: a fixed block of
BLOCK samples in which source i holds round(w_i * BLOCK) places, spread evenly (the j-th
sample of source i sits near (j + 1/2) / q_i of the block). Every prefix of the stream then
holds each source's share to within a couple of samples, not just on average, and the
source and its own sample index are computed per position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROUNDS = 6
BLOCK = 1 << 16
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast bijective scrambler of 64-bit words (wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class SeededPermutation:
    """A seeded bijection of [0, n), evaluated on index arrays."""

    def __init__(self, n: int, *key: int | str):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8 * ROUNDS).digest()
        self.keys = np.frombuffer(digest, dtype="<u8").copy()

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        """perm[idx] for int64 indices in [0, n)."""
        with np.errstate(over="ignore"):
            out = self._encrypt(np.asarray(idx, dtype=np.uint64))
            outside = out >= np.uint64(self.n)
            while outside.any():
                out[outside] = self._encrypt(out[outside])
                outside = out >= np.uint64(self.n)
        return out.astype(np.int64)


def window_order(n: int, seed: int, source: int, idx: np.ndarray) -> np.ndarray:
    """Window of each sample index of an endless stream over n windows: epoch e = idx // n
    visits every window once, in the permutation keyed by (seed, source, e)."""
    epochs, pos = np.divmod(np.asarray(idx, dtype=np.int64), n)
    out = np.empty_like(pos)
    for epoch in np.unique(epochs).tolist():
        mask = epochs == epoch
        out[mask] = SeededPermutation(n, seed, source, epoch)(pos[mask])
    return out


def quotas(weights: Sequence[float], block: int = BLOCK) -> np.ndarray:
    """Places per block for each source: largest remainders of w_i / sum(w) * block."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * block
    q = np.floor(exact).astype(np.int64)
    q[np.argsort(-(exact - q), kind="stable")[: block - q.sum()]] += 1
    return q


class MixtureSchedule:
    """Which source, and which of that source's samples, each stream position takes."""

    def __init__(self, weights: Sequence[float], block: int = BLOCK):
        self.block = block
        self.quotas = quotas(weights, block)
        src = np.repeat(np.arange(len(self.quotas)), self.quotas)
        nth = np.concatenate([np.arange(q) for q in self.quotas])
        when = (nth + 0.5) / np.repeat(self.quotas, self.quotas)
        order = np.lexsort((src, when))  # by time in the block, ties to the lower source
        self.source = src[order]
        self.nth = nth[order]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's own stream) for each position."""
        blocks, offset = np.divmod(np.asarray(positions, dtype=np.int64), self.block)
        source = self.source[offset]
        return source, blocks * self.quotas[source] + self.nth[offset]

    def counts(self, n: int) -> np.ndarray:
        """How many of positions [0, n) each source holds."""
        blocks, offset = divmod(n, self.block)
        return blocks * self.quotas + np.bincount(self.source[:offset], minlength=len(self.quotas))
