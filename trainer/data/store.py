"""The token store: flat token files, memory-mapped read-only and read as one stream.

Format (also what `scripts/prepare_data.py` and the text-corpus build write):
- `NAME.bin`: the token ids, back to back, little-endian, no header; documents are already
  joined as `[bos?] tokens [eos]`. Its dtype is in the sidecar `NAME.bin.json`:
  `{"dtype": "uint16" | "uint32" | "int32" | "int64"}`, optionally with `"tokens"` (the
  count, checked against the file size), `"vocab_size"` and `"tokenizer"` (weft's tokenizer
  fingerprint; a store written by another tokenizer is refused).
- `NAME.npy`: a 1-D integer NumPy array (the header holds the dtype).
Several files are read in sorted path order as one stream; windows may cross file ends.

Why memory-mapped: each rank maps the files read-only, so the pages live once in the OS
page cache, shared by every rank of a host, and only the pages a batch touches are read.
A rank's anonymous memory does not grow with the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import numpy as np

from trainer.config import ConfigError
from trainer.data.documents import SIDECAR_SUFFIX

DTYPES = ("uint16", "uint32", "int32", "int64")
HEAD_TOKENS = 1 << 16  # tokens hashed into a store's fingerprint
SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning for out-of-vocabulary ids


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest store dtype for ids in [0, vocab_size): uint16 up to 65,536, else uint32."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


class TokenFileWriter:
    """Appends token chunks to `path` (as `path.tmp-PID` until `close()` renames it) and
    writes the sidecar last, so a file with a sidecar is always complete."""

    def __init__(self, path: str, dtype: np.dtype, **sidecar: object):
        self.path = path
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.sidecar = sidecar
        self.tokens = 0
        self._tmp = f"{path}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside the range of {self.dtype.name} for {self.path}")
        arr.astype(self.dtype, copy=False).tofile(self._file)
        self.tokens += arr.size

    def close(self) -> None:
        self._file.close()
        os.replace(self._tmp, self.path)
        meta = {"dtype": self.dtype.name, "tokens": self.tokens, **self.sidecar}
        _write_json(self.path + SIDECAR_SUFFIX, meta)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
            os.unlink(self._tmp)


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_sidecar(path: str) -> dict | None:
    """The sidecar of a complete `.bin` file, or None when it has none."""
    try:
        with open(path + SIDECAR_SUFFIX) as f:
            meta = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ConfigError(f"token file sidecar '{path}{SIDECAR_SUFFIX}' is unreadable ({e}). Fix or rewrite it.") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"token file sidecar '{path}{SIDECAR_SUFFIX}' must hold a JSON object like "
                          '{"dtype": "uint32"}.')
    return meta


def _map_bin(path: str) -> tuple[np.ndarray, dict]:
    meta = read_sidecar(path)
    if meta is None:
        raise ConfigError(
            f"token file '{path}' has no sidecar '{path}{SIDECAR_SUFFIX}' giving its dtype. Write "
            f'{{"dtype": "uint32"}} (or uint16, int32, int64) there; see docs/data.md.'
        )
    dtype = meta.get("dtype")
    if dtype not in DTYPES:
        raise ConfigError(f"token file '{path}': sidecar dtype {dtype!r} is not one of {', '.join(DTYPES)}.")
    dt = np.dtype(dtype).newbyteorder("<")
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise ConfigError(f"token file '{path}' is {size} bytes, not a whole number of {dtype} tokens: "
                          "it is truncated or its sidecar dtype is wrong.")
    if "tokens" in meta and meta["tokens"] * dt.itemsize != size:
        raise ConfigError(f"token file '{path}' holds {size // dt.itemsize} tokens, its sidecar says "
                          f"{meta['tokens']}: the file is truncated or was changed. Rewrite it.")
    tokens = np.memmap(path, dtype=dt, mode="r") if size else np.empty(0, dt)
    return tokens, meta


def _map_npy(path: str) -> tuple[np.ndarray, dict]:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"token file '{path}' is not a readable .npy array ({e}).") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise ConfigError(f"token file '{path}' holds a {tokens.dtype} array of shape {tokens.shape}; "
                          "weft reads 1-D integer token arrays.")
    return tokens, {}


class TokenStore:
    """One read-only token stream over several arrays (memory-maps or, in tests, plain arrays)."""

    def __init__(self, parts: Sequence[tuple[str, np.ndarray]]):
        self.parts = [(name, arr) for name, arr in parts if len(arr)]
        lengths = [len(arr) for _, arr in self.parts]
        self.starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])

    @classmethod
    def open(cls, files: Sequence[str]) -> tuple[TokenStore, list[dict]]:
        """Map `.bin` / `.npy` files in the given order; returns the store and each file's sidecar."""
        mapped = [_map_npy(f) if f.lower().endswith(".npy") else _map_bin(f) for f in files]
        return cls([(f, arr) for f, (arr, _) in zip(files, mapped)]), [meta for _, meta in mapped]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream as int64, stitched across file ends."""
        out = np.empty(stop - start, dtype=np.int64)
        part = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self.starts[part])
            take = min(stop, int(self.starts[part + 1])) - pos
            out[pos - start : pos - start + take] = self.parts[part][1][pos - base : pos - base + take]
            pos += take
            part += 1
        return out

    def rows(self, offsets: np.ndarray, width: int) -> np.ndarray:
        """Rows of `width` tokens starting at each token offset, shape [len(offsets), width]."""
        out = np.empty((len(offsets), width), dtype=np.int64)
        for i, offset in enumerate(offsets.tolist()):
            out[i] = self.read(offset, offset + width)
        return out

    def head_hash(self) -> str:
        """blake2b of the first HEAD_TOKENS tokens as int64: part of the data fingerprint."""
        head = self.read(0, min(len(self), HEAD_TOKENS))
        return hashlib.blake2b(head.astype("<i8").tobytes(), digest_size=8).hexdigest()

    def id_range(self, name: str) -> tuple[int, int, int]:
        """(min id, max id, position of the max) of one file, read in chunks (no full copy)."""
        arr = dict(self.parts)[name]
        lo, hi, where = 0, -1, 0
        for start in range(0, len(arr), SCAN_CHUNK):
            chunk = arr[start : start + SCAN_CHUNK]
            cmax = int(chunk.max())
            lo = min(lo, int(chunk.min())) if start else int(chunk.min())
            if cmax > hi:
                hi, where = cmax, start + _first_index_of(chunk, cmax)
        return lo, hi, where


def _first_index_of(arr: np.ndarray, value: int, block: int = 1 << 20) -> int:
    """Index of the first `value` in `arr`, read `block` items at a time: numpy's argmax
    copies an unsigned-integer array whole (64 MiB per scan chunk, measured with numpy 2)."""
    for start in range(0, len(arr), block):
        hits = np.flatnonzero(arr[start : start + block] == value)
        if len(hits):
            return start + int(hits[0])
    raise ValueError(f"{value} is not in the array")
