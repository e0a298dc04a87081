"""Text corpus -> token store, tokenized in parallel, once per filesystem, resumable.

The documents of the input files are cut into work units (`documents.group_pieces`), and
a pool of `num_proc` processes tokenizes one unit each into `part-NNNNNN.bin` (+ sidecar):
`[bos?] tokens [eos]` per non-empty document, in file order, so the parts read in order
are exactly the old single packed stream. Parts land in `STORE.partial/`; a part with its
sidecar is complete, so a build that was killed restarts where it stopped. When every part
is there, `STORE.partial/` is renamed to `STORE/` (atomic), which is what readers wait for.

Progress and throughput (documents, tokens, input MB/s, tokens/s, ETA) go to the log every
PROGRESS_EVERY_S seconds and at the end.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import shutil
import time

import numpy as np

from trainer.data import documents
from trainer.data.documents import Piece, group_pieces, piece_bytes, plan_pieces, read_documents
from trainer.data.lock import build_once
from trainer.data.store import TokenFileWriter, read_sidecar, token_dtype
from trainer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # bump when what a store holds for the same inputs changes
KEY_FILE = "STORE_KEY"  # in a store folder: the key of the inputs its parts were made from
BATCH_DOCS = 256  # documents per encode_batch call
PROGRESS_EVERY_S = 10.0

_worker_tokenizer: Tokenizer | None = None


def store_key(files: list[str], tokenizer: Tokenizer, *, lenient: bool) -> str:
    """Names a store by everything its content and its part layout depend on: each input
    file's path, size and mtime, how they are read and cut into pieces, the tokenizer and
    the layout version. Computed without opening the files, so a cached store is found fast."""
    head = (f"{LAYOUT_VERSION} {tokenizer.fingerprint} {tokenizer.prepend_bos} {lenient} "
            f"{documents.PIECE_BYTES_MIN} {documents.PIECE_BYTES_MAX}")
    h = hashlib.sha256(head.encode())
    for path in files:
        st = os.stat(path)
        h.update(f"\n{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def store_parts(store_dir: str) -> list[str]:
    """The part files of a finished store, in stream order."""
    return sorted(os.path.join(store_dir, f) for f in os.listdir(store_dir) if f.endswith(".bin"))


def _init_worker(tokenizer: Tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_unit(args: tuple[int, list[Piece], str]) -> tuple[int, int, int]:
    """Tokenize one unit into `part_path`; returns (unit index, documents, tokens)."""
    index, unit, part_path = args
    tok = _worker_tokenizer
    bos = tok.prepend_bos
    docs = 0
    with TokenFileWriter(part_path, token_dtype(tok.n_words), tokenizer=tok.fingerprint,
                         vocab_size=tok.n_words) as writer:
        for piece in unit:
            batch: list[str] = []
            for text in read_documents(piece):
                batch.append(text)
                if len(batch) == BATCH_DOCS:
                    writer.write(np.concatenate(tok.encode_batch(batch, bos=bos, eos=True)))
                    docs, batch = docs + len(batch), []
            if batch:
                writer.write(np.concatenate(tok.encode_batch(batch, bos=bos, eos=True)))
                docs += len(batch)
    return index, docs, writer.tokens


def _part_name(index: int) -> str:
    return f"part-{index:06d}.bin"


class _Progress:
    def __init__(self, name: str, units: list[list[Piece]], done: set[int], num_proc: int):
        self.name = name
        self.unit_bytes = [sum(piece_bytes(p) for p in unit) for unit in units]
        self.total_bytes = sum(self.unit_bytes)
        self.done_bytes = sum(self.unit_bytes[i] for i in done)
        self.new_bytes = self.docs = self.tokens = 0
        self.start = self.last = time.perf_counter()
        logger.info(f"tokenizing {name}: {self.total_bytes / 1e6:,.1f} MB in {len(units)} units with "
                    f"{num_proc} process(es); {len(done)} units already done")

    def update(self, index: int, docs: int, tokens: int) -> None:
        self.docs += docs
        self.tokens += tokens
        self.new_bytes += self.unit_bytes[index]
        now = time.perf_counter()
        if now - self.last >= PROGRESS_EVERY_S:
            self.last = now
            logger.info(f"tokenizing {self.name}: {self._line(now)}")

    def _line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.new_bytes / elapsed
        left = self.total_bytes - self.done_bytes - self.new_bytes
        eta = f", ETA {left / rate:.0f} s" if rate and left else ""
        return (f"{(self.done_bytes + self.new_bytes) / max(self.total_bytes, 1):.0%}, {self.docs:,} documents, "
                f"{self.tokens:,} tokens in {elapsed:.1f} s ({self.tokens / elapsed:,.0f} tokens/s, "
                f"{rate / 1e6:.1f} MB/s){eta}")

    def finish(self) -> float:
        now = time.perf_counter()
        logger.info(f"tokenized {self.name}: {self._line(now)}")
        return self.tokens / max(now - self.start, 1e-9)


def _read_key(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _pool_context() -> mp.context.BaseContext:
    """fork where there is one: workers start at once with the tokenizer already loaded, where
    spawn would import torch again in each (~20 s on a loaded 2-core box). The workers only
    read files, tokenize and write, never touching the process group or the GPU, which is
    what makes forking a process that runs gloo/NCCL threads safe here (as for torch's
    DataLoader workers)."""
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def write_store(out_dir: str, files: list[str], tokenizer: Tokenizer, *, lenient: bool, num_proc: int,
                name: str) -> float:
    """Tokenize `files` into the store `out_dir` (via `out_dir.partial/`, reusing finished
    parts). Returns tokens/s of this call's tokenization. Not locked: see `build_store`.
    `lenient` reads bad UTF-8 as replacement characters (the stdlib corpus)."""
    units = group_pieces(plan_pieces(files, lenient=lenient))
    partial = out_dir + ".partial"
    key, key_file = store_key(files, tokenizer, lenient=lenient), os.path.join(partial, KEY_FILE)
    if os.path.isdir(partial) and _read_key(key_file) != key:
        shutil.rmtree(partial)  # parts of other inputs (the files changed since)
    os.makedirs(partial, exist_ok=True)
    with open(key_file, "w") as f:
        f.write(key)
    done = {i for i in range(len(units)) if read_sidecar(os.path.join(partial, _part_name(i))) is not None}
    todo = [(i, units[i], os.path.join(partial, _part_name(i))) for i in range(len(units)) if i not in done]
    num_proc = max(1, min(num_proc, len(todo)))
    progress = _Progress(name, units, done, num_proc)
    if num_proc == 1:
        _init_worker(tokenizer)
        for unit in todo:
            progress.update(*_tokenize_unit(unit))
    else:
        with _pool_context().Pool(num_proc, initializer=_init_worker, initargs=(tokenizer,)) as pool:
            for result in pool.imap_unordered(_tokenize_unit, todo):
                progress.update(*result)
    rate = progress.finish()
    try:
        os.rename(partial, out_dir)
    except OSError:
        if not os.path.isdir(out_dir):  # else another builder published the same store first
            raise
        shutil.rmtree(partial, ignore_errors=True)
    return rate


def build_store(files: list[str], tokenizer: Tokenizer, cache_dir: str, *, lenient: bool, num_proc: int,
                name: str) -> str:
    """The store of `files` under `cache_dir`, built here or by whichever process got there
    first (see lock.py). Returns its folder."""
    os.makedirs(cache_dir, exist_ok=True)
    out_dir = os.path.join(cache_dir, f"tokens-{store_key(files, tokenizer, lenient=lenient)}")
    build_once(out_dir, lambda: write_store(out_dir, files, tokenizer, lenient=lenient, num_proc=num_proc,
                                            name=name),
               what=f"tokenizing {name}")
    return out_dir


def default_num_proc() -> int:
    """Every CPU this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
