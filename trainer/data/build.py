"""From the config to a loader: which sources, stored or streamed, and the validation split.

- Stored (default): text files and "stdlib" are tokenized once into a token store under
  `<dump_folder>/.cache/data` (ingest.py); `.bin` / `.npy` token files are mapped as they
  are, after a one-time check that every id fits the tokenizer's vocabulary.
- Streamed (`training.dataset_streaming`, and always for a hub dataset name): documents
  flow through `datasets` streaming, shuffled in a seeded buffer and sharded per dp rank.

Validation without `validation.dataset_path` is held out of the training data, whether
validation is on or not, so turning it on never changes the training stream: the last
windows of each stored source, or 1 document in STREAM_VAL_EVERY of a stream (chosen by a
hash of its text, so the choice does not depend on order, shards or dp).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os

import torch

from trainer.config import ConfigError, Training
from trainer.data.documents import (
    STDLIB,
    TEXT_FORMATS,
    TOKEN_FORMATS,
    generate_documents,
    is_pretokenized,
    plan_pieces,
    resolve_files,
)
from trainer.data.ingest import build_store, default_num_proc, store_parts
from trainer.data.loader import TokenDataLoader
from trainer.data.lock import build_once
from trainer.data.order import BLOCK
from trainer.data.sources import StoreWindows, StreamWindows, WindowSource
from trainer.data.store import TokenStore
from trainer.tokenizer import Tokenizer

VAL_FRACTION = 0.01  # share of windows held out for validation when no validation path is set
VAL_MIN_WINDOWS = 4  # ...but at least this many (never more than a tenth of the data)
STREAM_VAL_EVERY = 100  # a stream holds out the documents whose text hash is 0 modulo this
STREAM_SHUFFLE_BUFFER = 10_000  # documents in the shuffle buffer of a stream
MIXTURE_KEY = "training.dataset_mixture"


def validation_windows(n_windows: int) -> int:
    """How many trailing windows are held out for validation when no validation path is set."""
    return min(max(int(n_windows * VAL_FRACTION), VAL_MIN_WINDOWS), n_windows // 10)


def parse_mixture(items: list[str]) -> list[tuple[str, float]]:
    """`["data/web:0.8", "data/code:0.2"]` -> [(source, weight)]; weights need not sum to 1."""
    out = []
    for item in items:
        source, sep, weight = item.rpartition(":")
        try:
            w = float(weight)
        except ValueError:
            w = math.nan
        if not sep or not source or not math.isfinite(w) or w <= 0:
            raise ConfigError(
                f"{MIXTURE_KEY} item {item!r} must be 'SOURCE:WEIGHT' with a positive weight, e.g. "
                "'data/web:0.8'."
            )
        out.append((source, w))
    total = sum(w for _, w in out)
    for source, w in out:
        if w / total * BLOCK < 1:
            raise ConfigError(f"{MIXTURE_KEY}: the weight of '{source}' is below 1/{BLOCK} of the total; "
                              "raise it or drop the source.")
    return out


def is_hub_name(source: str) -> bool:
    """Anything but a local source (stdlib, an existing path, a glob, ./ / ~ prefixes, a known suffix)."""
    local = (source == STDLIB or os.path.exists(source) or glob.has_magic(source)
             or source.startswith(("/", ".", "~")) or os.path.splitext(source)[1].lower() in TEXT_FORMATS + TOKEN_FORMATS)
    return not local


def _id_range_cached(store: TokenStore, path: str, cache_dir: str) -> tuple[int, int, int]:
    """(min, max, position of max) of one token file, scanned once per filesystem and cached."""
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns}".encode()).hexdigest()[:32]
    target = os.path.join(cache_dir, f"ids-{key}.json")

    def scan() -> None:
        tmp = f"{target}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(store.id_range(path), f)
        os.replace(tmp, target)

    os.makedirs(cache_dir, exist_ok=True)
    build_once(target, scan, what=f"checking the token ids of {path}")
    with open(target) as f:
        return tuple(json.load(f))


def check_token_ids(store: TokenStore, files: list[str], sidecars: list[dict], tokenizer: Tokenizer,
                    cache_dir: str) -> None:
    """Every id of pre-tokenized files must be a token of this tokenizer: an id past the
    vocabulary would index padding rows of the embedding (or past it) without an error."""
    vocab = tokenizer.n_words
    fix = ("Tokenize the data with the tokenizer of model.tokenizer_path, or set model.tokenizer_path to "
           "the one it was written with.")
    for path, meta in zip(files, sidecars):
        if meta.get("tokenizer") == tokenizer.fingerprint:
            continue  # written by weft with this very tokenizer
        if meta.get("tokenizer") is not None:
            raise ConfigError(f"token file '{path}' was written by another tokenizer ({meta['tokenizer']}, this "
                              f"run's is {tokenizer.fingerprint}). {fix}")
        if meta.get("vocab_size") not in (None, vocab):
            raise ConfigError(f"token file '{path}' is for a vocabulary of {meta['vocab_size']} ids; the "
                              f"tokenizer has {vocab}. {fix}")
        if os.path.getsize(path) == 0:
            continue
        lo, hi, where = _id_range_cached(store, path, cache_dir)
        if lo < 0:
            raise ConfigError(f"token file '{path}' holds the negative id {lo}. {fix}")
        if hi >= vocab:
            raise ConfigError(f"token file '{path}' holds id {hi} (token {where}), past the tokenizer's "
                              f"vocabulary of {vocab} ids. {fix}")


def open_store(source: str, tokenizer: Tokenizer, cache_dir: str, *, key: str, num_proc: int) -> TokenStore:
    """The memory-mapped token store of `source`: pre-tokenized files as they are, text
    tokenized into a cached store first (by whichever process gets the lock)."""
    files = resolve_files(source, key)
    if is_pretokenized(files):
        store, sidecars = TokenStore.open(files)
        check_token_ids(store, files, sidecars, tokenizer, cache_dir)
        return store
    store_dir = build_store(files, tokenizer, cache_dir, lenient=source == STDLIB,
                            num_proc=num_proc or default_num_proc(), name=source)
    return TokenStore.open(store_parts(store_dir))[0]


def _stored(key: str, source: str, source_id: int, tokenizer: Tokenizer, t: Training, cache_dir: str,
            split: str, held_out: bool) -> StoreWindows:
    store = open_store(source, tokenizer, cache_dir, key=key, num_proc=t.dataset_num_proc)
    windows = StoreWindows(source, store, t.seq_len, seed=t.seed, source_id=source_id)
    if len(windows) == 0:
        raise ConfigError(
            f"{key} '{source}' holds {len(store)} tokens, fewer than one window of training.seq_len + 1 "
            f"= {t.seq_len + 1}. Add data or lower training.seq_len."
        )
    if held_out:
        train, val = windows.split_tail(validation_windows(len(windows)))
        windows = val if split == "validation" else train
        if len(windows) == 0:
            raise ConfigError(
                f"{key} '{source}' has only {len(train)} windows of {t.seq_len + 1} tokens, too few to hold "
                "out a validation split. Set validation.dataset_path or add data."
            )
    return windows


def is_held_out(text: str | None) -> bool:
    if not text:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % STREAM_VAL_EVERY == 0


def _keep(example: dict, validation: bool) -> bool:
    return is_held_out(example.get("text")) == validation


def _streamable_files(source: str, key: str) -> list[str]:
    """`resolve_files`, refusing token files: those are memory-mapped, never streamed."""
    files = resolve_files(source, key)
    if is_pretokenized(files):
        raise ConfigError(f"{key} '{source}' holds token files, which are memory-mapped, not streamed. "
                          "Set training.dataset_streaming = false.")
    return files


def _streamed(key: str, source: str, tokenizer: Tokenizer, t: Training, split: str, held_out: bool,
              dp_rank: int, dp_degree: int) -> StreamWindows:
    # Imported here: `datasets` (with pandas and pyarrow) takes over a second to import, and only
    # streaming runs need it; every other process, test and dry run would pay for it.
    import datasets
    from datasets.distributed import split_dataset_by_node

    if is_hub_name(source):
        try:
            docs = datasets.load_dataset(source, split="train", streaming=True)
        except Exception as e:  # offline, unknown name, missing split: all mean the same fix
            raise ConfigError(
                f"{key} '{source}' is not a local path and streaming it from the Hugging Face hub failed "
                f"({type(e).__name__}). Use a local path, or check the name and the network."
            ) from e
    else:
        files = _streamable_files(source, key)
        pieces = plan_pieces(files, lenient=source == STDLIB)
        docs = datasets.IterableDataset.from_generator(generate_documents, gen_kwargs={"pieces": pieces})
    if held_out:
        docs = docs.filter(_keep, fn_kwargs={"validation": split == "validation"})
    docs = docs.shuffle(seed=t.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
    docs = split_dataset_by_node(docs, rank=dp_rank, world_size=dp_degree)
    return StreamWindows(source, docs, tokenizer, t.seq_len)


def _entries(t: Training, dataset_path: str | None) -> tuple[list[tuple[str, str, float]], bool]:
    """The loader's sources as (config key, source, weight), and whether validation is held out
    of them: `dataset_path` (validation's own data) first, then a mixture, a path, a dataset name."""
    if dataset_path:
        return [("validation.dataset_path", dataset_path, 1.0)], False
    if t.dataset_mixture:
        return [(MIXTURE_KEY, s, w) for s, w in parse_mixture(t.dataset_mixture)], True
    if t.dataset_path:
        return [("training.dataset_path", t.dataset_path, 1.0)], True
    return [("training.dataset", t.dataset, 1.0)], True


def _is_streamed(t: Training, entries: list[tuple[str, str, float]]) -> bool:
    """Streamed when asked for, and always when a source is a hub dataset name."""
    return t.dataset_streaming or any(is_hub_name(source) for _, source, _ in entries)


def check_data_sources(training: Training, validation_path: str | None = None) -> None:
    """Raise ConfigError if a local source of the training data (or of `validation_path`) matches
    no files of one supported format, a streamed one holds token files, or the mixture is
    malformed.

    Why here: the loader finds this out only inside every rank, after the process group is up,
    where the launcher then adds its own failure report per rank. This is the same glob the
    loader makes, without tokenizing or opening anything. Hub names are left to the loader:
    checking them would need the network.
    """
    for dataset_path in [None, validation_path] if validation_path else [None]:
        entries = _entries(training, dataset_path)[0]
        find_files = _streamable_files if _is_streamed(training, entries) else resolve_files
        for key, source, _ in entries:
            if source != STDLIB and not is_hub_name(source):
                find_files(source, key)


def build_dataloader(
    training: Training,
    tokenizer: Tokenizer,
    *,
    global_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    device: torch.device | str,
    dump_folder: str,
    split: str = "train",
    dataset_path: str | None = None,
    allow_data_change: bool = False,
) -> TokenDataLoader:
    """The loader for `split` ("train" or "validation") of this data-parallel rank.

    `global_batch_size` is the resolved global batch (never -1); `dp_rank` / `dp_degree`
    describe the whole data-parallel world (replicate x shard). `dataset_path` is
    `validation.dataset_path`: validation data instead of the held-out split.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    t = training
    entries, held_out = _entries(t, dataset_path)
    streaming = _is_streamed(t, entries)
    cache_dir = os.path.join(dump_folder, ".cache", "data")
    sources: list[WindowSource] = []
    for i, (key, source, _) in enumerate(entries):
        if streaming:
            sources.append(_streamed(key, source, tokenizer, t, split, held_out, dp_rank, dp_degree))
        else:
            sources.append(_stored(key, source, i, tokenizer, t, cache_dir, split, held_out))
    return TokenDataLoader(
        sources, [w for _, _, w in entries], seq_len=t.seq_len, global_batch_size=global_batch_size,
        local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree, seed=t.seed, device=device,
        allow_data_change=allow_data_change,
    )
