"""Kinds of window sources behind one interface: `windows(idx)` gives rows of `seq_len + 1`
tokens for indices into the source's own endless sample stream.

- `StoreWindows`: a memory-mapped token store, cut into back-to-back windows, visited in a
  seeded order epoch after epoch. Random access: any index, any time, any rank.
- `StreamWindows`: documents from a `datasets` streaming `IterableDataset` (this rank's
  shard), packed into windows on the fly. Sequential: indices must continue where the last
  call stopped; going back restarts the stream (validation reads the same batches each
  time), going ahead reads and drops windows (resume).

The loader never asks which kind it holds, except through `rank_local`: a stream is
sharded per data-parallel rank, so its indices count this rank's samples, not global ones.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.config import ConfigError
from trainer.data.order import window_order

if TYPE_CHECKING:  # imported where streaming runs (trainer/data/build.py): it is slow to import
    import datasets
from trainer.data.store import TokenStore
from trainer.tokenizer import Tokenizer

SKIP_CHUNK = 256  # windows per read while a resumed stream catches up


class WindowSource(ABC):
    """A source of windows; `name` labels it in logs, metrics and errors."""

    name: str
    seq_len: int
    rank_local: bool = False

    @abstractmethod
    def windows(self, idx: np.ndarray) -> np.ndarray:
        """int64 rows [len(idx), seq_len + 1] for sample indices `idx` of this source."""

    @abstractmethod
    def identity(self) -> dict[str, Any]:
        """What a checkpoint records to recognise this data on resume."""


class StoreWindows(WindowSource):
    """Windows [start, stop) of `store` in the seeded order of `order.window_order`."""

    def __init__(self, name: str, store: TokenStore, seq_len: int, *, seed: int, source_id: int = 0,
                 start: int = 0, stop: int | None = None):
        self.name = name
        self.store = store
        self.seq_len = seq_len
        self.seed = seed
        self.source_id = source_id
        self.start = start
        self.stop = len(store) // (seq_len + 1) if stop is None else stop
        self._head_hash: str | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def split_tail(self, n: int) -> tuple[StoreWindows, StoreWindows]:
        """(all but the last n windows, the last n windows)."""
        cut = self.stop - n
        kw = dict(seed=self.seed, source_id=self.source_id)
        return (StoreWindows(self.name, self.store, self.seq_len, start=self.start, stop=cut, **kw),
                StoreWindows(self.name, self.store, self.seq_len, start=cut, stop=self.stop, **kw))

    def windows(self, idx: np.ndarray) -> np.ndarray:
        width = self.seq_len + 1
        window = window_order(len(self), self.seed, self.source_id, idx)
        return self.store.rows((self.start + window) * width, width)

    def identity(self) -> dict[str, Any]:
        if self._head_hash is None:
            self._head_hash = self.store.head_hash()
        return {"name": self.name, "windows": len(self), "tokens": len(self.store), "head": self._head_hash}


class StreamWindows(WindowSource):
    """Windows packed from this rank's shard of a streamed dataset of `{"text": ...}` records.

    Epoch e iterates the dataset after `set_epoch(e)` (a seeded reshuffle); when it ends,
    the next epoch starts. Nothing is cached: restarting replays the same documents.
    """

    rank_local = True

    def __init__(self, name: str, docs: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int):
        self.name = name
        self.docs = docs
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self._restart()

    def _restart(self) -> None:
        self.epoch = 0
        self.next_index = 0
        self._iter: Iterator[dict[str, Any]] | None = None
        self._buffer = np.empty(0, dtype=np.int64)

    def _next_doc(self) -> list[int]:
        for _ in range(2):
            if self._iter is None:
                self.docs.set_epoch(self.epoch)
                self._iter = iter(self.docs)
            for example in self._iter:
                text = example.get("text")
                if text is not None and not isinstance(text, str):
                    raise ConfigError(f"streamed dataset '{self.name}' has a 'text' of type "
                                      f"{type(text).__name__}; weft reads text documents.")
                if text:
                    return self.tokenizer.encode(text, bos=self.tokenizer.prepend_bos, eos=True)
            self._iter = None
            self.epoch += 1
        raise ConfigError(
            f"streamed dataset '{self.name}' yields no 'text' documents on this rank. Check the dataset "
            "(a held-out validation stream keeps 1 document in 100: give it more documents, or set "
            "validation.dataset_path)."
        )

    def _take(self, n: int) -> np.ndarray:
        width = self.seq_len + 1
        need = n * width
        pieces = [self._buffer]
        have = len(self._buffer)
        while have < need:
            doc = np.asarray(self._next_doc(), dtype=np.int64)
            pieces.append(doc)
            have += len(doc)
        tokens = np.concatenate(pieces)
        self._buffer = tokens[need:].copy()  # a view would keep all of `tokens` alive
        self.next_index += n
        return tokens[:need].reshape(n, width)

    def windows(self, idx: np.ndarray) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if len(idx) == 0:
            return np.empty((0, self.seq_len + 1), dtype=np.int64)
        first = int(idx[0])
        if not np.array_equal(idx, np.arange(first, first + len(idx))):
            raise ValueError(f"a stream is read in order; asked for indices {idx[:4].tolist()}...")
        if first < self.next_index:
            self._restart()
        while self.next_index < first:  # read up to the resume point, a bounded chunk at a time
            self._take(min(first - self.next_index, SKIP_CHUNK))
        return self._take(len(idx))

    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "streamed": True}
