"""Token data: documents -> one packed token stream -> windows in a seeded global order.

Why it is built this way: the sequences an optimizer step trains on must not depend on the
mesh. Documents are tokenized once (cached by `datasets`) and joined as
`[bos?] tokens [eos]` into one flat stream, cut into non-overlapping windows of
`seq_len + 1` tokens. Epoch e visits all windows in a permutation seeded by
(training.seed, e). Step s trains on global samples [s*G, (s+1)*G) of that endless stream;
data-parallel rank r takes rows [r*G/dp, (r+1)*G/dp) and splits them into micro-batches.
So changing dp or the local batch size changes who computes a row, never which rows a step
sees, and resuming only needs the number of global samples consumed.

Hub datasets (training.dataset = a name) are the exception: they are streamed, each dp rank
reads its own shard, and the order depends on dp (see docs/data.md).
"""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import datasets
import numpy as np
import torch
import torch.distributed as dist
from datasets.distributed import split_dataset_by_node
from datasets.exceptions import DatasetGenerationError

from trainer.config import ConfigError, Training
from trainer.tokenizer import Tokenizer

FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
CACHE_VERSION = 1  # bump when the token layout written to the cache changes
VAL_FRACTION = 0.01  # share of windows held out for validation when no validation path is set
VAL_MIN_WINDOWS = 4  # ...but at least this many (never more than a tenth of the data)
STREAM_SHUFFLE_BUFFER = 10_000  # documents in the shuffle buffer of a streamed hub dataset

T = TypeVar("T")


class PackedWindows:
    """Windows [start, stop) of `seq_len + 1` tokens cut back to back from a flat token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, stop: int | None = None):
        total = len(tokens) // (seq_len + 1)
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start
        self.stop = total if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        """Rows of windows `idx` (positions within this range), shape [len(idx), seq_len + 1]."""
        width = self.seq_len + 1
        offsets = (self.start + np.asarray(idx, dtype=np.int64))[:, None] * width + np.arange(width)
        return self.tokens[offsets]

    def split_tail(self, n: int) -> tuple[PackedWindows, PackedWindows]:
        """(all but the last n windows, the last n windows)."""
        cut = self.stop - n
        return (PackedWindows(self.tokens, self.seq_len, self.start, cut),
                PackedWindows(self.tokens, self.seq_len, cut, self.stop))


class StreamingWindows:
    """Windows packed on the fly from this dp rank's shard of a streamed `IterableDataset`.

    Each rank reads its own shard in the order `datasets` gives it, so the rows of a step
    depend on dp; restarting the iteration when the shard ends starts the next epoch.
    """

    def __init__(self, docs: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, key: str):
        self.docs = docs
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.key = key
        self.epoch = 0
        self._iter: Iterator[dict[str, Any]] | None = None
        self._buffer: list[int] = []

    def _next_doc(self) -> list[int]:
        for _ in range(2):
            if self._iter is None:
                self.docs.set_epoch(self.epoch)
                self._iter = iter(self.docs)
            for example in self._iter:
                text = example.get("text") or ""
                if text:
                    return self.tokenizer.encode(text, bos=self.tokenizer.prepend_bos, eos=True)
            self._iter = None
            self.epoch += 1
        raise ConfigError(
            f"{self.key}: this rank's shard of the streamed dataset yields no 'text'. Check the dataset name."
        )

    def take(self, n: int) -> np.ndarray:
        """The next n windows of this rank's stream, shape [n, seq_len + 1]."""
        width = self.seq_len + 1
        while len(self._buffer) < n * width:
            self._buffer.extend(self._next_doc())
        rows = np.asarray(self._buffer[: n * width], dtype=np.int32).reshape(n, width)
        del self._buffer[: n * width]
        return rows


def check_batch_sizes(global_batch_size: int, local_batch_size: int, dp_degree: int) -> None:
    step_rows = local_batch_size * dp_degree
    if global_batch_size < 1 or global_batch_size % step_rows:
        fix = max(step_rows, global_batch_size // step_rows * step_rows)
        raise ConfigError(
            f"training.global_batch_size ({global_batch_size}) must be a positive multiple of "
            f"training.local_batch_size ({local_batch_size}) x parallelism.data_parallel_shard_degree "
            f"({dp_degree}) = {step_rows}. Set training.global_batch_size to e.g. {fix} (or -1), or "
            "change training.local_batch_size."
        )


class TokenDataLoader:
    """Stateful loader: `next_step()` returns this dp rank's micro-batches for one optimizer step."""

    def __init__(
        self,
        windows_source: PackedWindows | StreamingWindows,
        *,
        seq_len: int,
        global_batch_size: int,
        local_batch_size: int,
        dp_rank: int,
        dp_degree: int,
        seed: int,
        device: torch.device | str = "cpu",
    ):
        check_batch_sizes(global_batch_size, local_batch_size, dp_degree)
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_degree})")
        if windows_source.seq_len != seq_len:
            raise ValueError(f"windows hold seq_len {windows_source.seq_len}, loader asked for {seq_len}")
        if isinstance(windows_source, PackedWindows) and len(windows_source) == 0:
            raise ValueError("windows_source holds no windows")
        self.source = windows_source
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self.seed = seed
        self.device = torch.device(device)
        self.samples_consumed = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_degree * self.local_batch_size)

    @property
    def streaming(self) -> bool:
        return isinstance(self.source, StreamingWindows)

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            rng = np.random.default_rng([self.seed % 2**64, epoch])
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}  # a step may span two
            self._perms[epoch] = rng.permutation(len(self.source))
        return self._perms[epoch]

    def global_rows(self, start: int, stop: int) -> np.ndarray:
        """Global samples [start, stop) of the shuffled endless stream, shape [stop-start, seq_len+1]."""
        epochs, pos = np.divmod(np.arange(start, stop), len(self.source))
        windows = np.empty_like(pos)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            windows[mask] = self._perm(int(epoch))[pos[mask]]
        return self.source[windows]

    def _to_device(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1], dtype=np.int64))
        labels = torch.from_numpy(np.ascontiguousarray(rows[:, 1:], dtype=np.int64))
        if self.device.type == "cuda":
            return (inputs.pin_memory().to(self.device, non_blocking=True),
                    labels.pin_memory().to(self.device, non_blocking=True))
        return inputs.to(self.device), labels.to(self.device)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches (input_ids, labels), each int64 [local_batch_size, seq_len]."""
        per_rank = self.global_batch_size // self.dp_degree
        if self.streaming:
            rows = self.source.take(per_rank)
        else:
            first = self.samples_consumed + self.dp_rank * per_rank
            rows = self.global_rows(first, first + per_rank)
        self.samples_consumed += self.global_batch_size
        lbs = self.local_batch_size
        return [self._to_device(rows[i : i + lbs]) for i in range(0, per_rank, lbs)]

    def reset(self) -> None:
        """Back to the first step (used to score the same validation batches every time)."""
        if self.streaming:
            raise ValueError("a streamed dataset cannot be rewound; build a new loader instead")
        self.samples_consumed = 0

    def state_dict(self) -> dict[str, int]:
        sd = {
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
        }
        if self.streaming:
            sd["dp_degree"] = self.dp_degree  # a streamed order is per rank: only that dp can resume it
        else:
            sd["num_windows"] = len(self.source)
        return sd

    def load_state_dict(self, sd: dict[str, int]) -> None:
        keys = {
            "seed": "training.seed",
            "seq_len": "training.seq_len",
            "global_batch_size": "training.global_batch_size",
            "num_windows": "training.dataset_path",
            "dp_degree": "parallelism.data_parallel_shard_degree",
        }
        mine = self.state_dict()
        for name, key in keys.items():
            if (name in sd or name in mine) and sd.get(name) != mine.get(name):
                what = "the number of windows in the data" if name == "num_windows" else key
                raise ConfigError(
                    f"cannot resume the data loader: the checkpoint was written with {what} = "
                    f"{sd.get(name)}, this run has {mine.get(name)}. Resume with the same {key}, or "
                    "start a fresh run in a new job.dump_folder."
                )
        if self.streaming:  # replay this rank's stream up to the checkpoint, one step at a time
            for _ in range(int(sd["samples_consumed"]) // self.global_batch_size):
                self.source.take(self.global_batch_size // self.dp_degree)
        self.samples_consumed = int(sd["samples_consumed"])


def stdlib_files(max_files: int | None = None) -> list[str]:
    """The embedded default corpus: the Python standard library's own .py sources.

    All `.py` files under `sysconfig.get_paths()['stdlib']` (site-/dist-packages excluded),
    sorted by path: ~30 MB / ~8M cl100k tokens on CPython 3.11, present everywhere, no
    download. It differs between Python versions, which is why the cache key includes every
    file's size and mtime. `max_files` keeps the first N (tests).
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    files.sort()
    return files[:max_files]


def resolve_files(source: str, key: str) -> list[str]:
    """A file, a folder (searched recursively) or a glob -> sorted files of supported formats."""
    source = os.path.expanduser(source)
    if os.path.isdir(source):
        found = glob.glob(os.path.join(glob.escape(source), "**", "*"), recursive=True)
    else:
        found = glob.glob(source, recursive=True)
    files = sorted(f for f in found if os.path.isfile(f) and os.path.splitext(f)[1].lower() in FORMATS)
    if not files:
        raise ConfigError(
            f"{key} '{source}' matches no {'/'.join(FORMATS)} files. Point it at a folder or glob "
            "of such files (e.g. 'data/*.jsonl')."
        )
    return files


def _read_documents(files: list[str], source: str, key: str, cache_dir: str) -> datasets.Dataset:
    """Documents of local files through `datasets`' packaged builders (nothing is downloaded)."""
    builders = {FORMATS[os.path.splitext(f)[1].lower()] for f in files}
    if len(builders) > 1:
        raise ConfigError(
            f"{key} '{source}' mixes formats ({sorted(builders)}). Point it at files of one format."
        )
    builder = builders.pop()
    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        docs = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=cache_dir, **kwargs)
    except (OSError, ValueError, DatasetGenerationError) as e:
        root = e.__cause__ or e  # DatasetGenerationError wraps the informative error
        reason = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
        raise ConfigError(
            f"{key} '{source}': cannot read the {builder} files ({reason}). Fix or remove them."
        ) from e
    if "text" not in docs.column_names:
        raise ConfigError(
            f"{key} '{source}' has no 'text' field (found {docs.column_names}). Store each document "
            "in a 'text' field/column."
        )
    return docs.select_columns(["text"])


def _stdlib_documents(files: list[str]) -> datasets.Dataset:
    texts = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    return datasets.Dataset.from_dict({"text": texts})


def load_token_stream(
    source: str, tokenizer: Tokenizer, cache_dir: str, *, key: str = "training.dataset_path",
    max_files: int | None = None,
) -> np.ndarray:
    """Tokenize the documents of `source` ("stdlib" or local files) into one flat int32 stream.

    The tokenized documents are an Arrow file written by `datasets.Dataset.map` under
    `cache_dir`, named by a key over the files (path, size, mtime), the tokenizer and the
    layout version, so a second call reads it back (memory-mapped) without tokenizing.
    """
    files = stdlib_files(max_files) if source == "stdlib" else resolve_files(source, key)[:max_files]
    h = hashlib.sha256(f"{CACHE_VERSION} {tokenizer.fingerprint} {tokenizer.prepend_bos}".encode())
    for path in files:
        st = os.stat(path)
        h.update(f"\n{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns}".encode())
    fingerprint = h.hexdigest()[:32]
    cache_file = os.path.join(cache_dir, f"tokens-{fingerprint}.arrow")
    if os.path.exists(cache_file):
        tokenized = datasets.Dataset.from_file(cache_file)
    else:
        os.makedirs(cache_dir, exist_ok=True)
        if source == "stdlib":
            docs = _stdlib_documents(files)
        else:
            docs = _read_documents(files, source, key, cache_dir)
        bos = tokenizer.prepend_bos

        def tokenize(batch: dict[str, list]) -> dict[str, list]:
            texts = [t or "" for t in batch["text"]]
            ids = tokenizer.encode_batch(texts, bos=bos, eos=True)
            return {"ids": [x if t else [] for x, t in zip(ids, texts)]}

        tokenized = docs.map(
            tokenize,
            batched=True,
            remove_columns=docs.column_names,
            features=datasets.Features({"ids": datasets.List(datasets.Value("int32"))}),
            cache_file_name=cache_file,
            new_fingerprint=fingerprint,
            desc="tokenizing",
        )
    chunks = [c.flatten().to_numpy() for c in tokenized.data.column("ids").chunks]
    return np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int32)


def _local_rank_zero_first(fn: Callable[[], T]) -> T:
    """Run `fn` on each host's local rank 0 first (it fills the cache), then on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return fn()
    first = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    if not first:
        dist.barrier()
    out = fn()
    if first:
        dist.barrier()
    return out


def _is_local(source: str) -> bool:
    """Anything but a hub name (`org/name`): an existing path, a glob, ./ / ~ prefixes, known suffixes."""
    return (os.path.exists(source) or glob.has_magic(source) or source.startswith(("/", ".", "~"))
            or os.path.splitext(source)[1].lower() in FORMATS)


def _stream_hub(name: str, split: str, key: str, tokenizer: Tokenizer, seq_len: int, seed: int,
                dp_rank: int, dp_degree: int) -> StreamingWindows:
    try:
        docs = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # offline, unknown name, missing split: all mean the same fix
        raise ConfigError(
            f"{key} '{name}' is not a local path and streaming split '{split}' of it from the "
            f"Hugging Face hub failed ({type(e).__name__}). Use training.dataset_path for local data, "
            "or check the name and the network."
        ) from e
    docs = docs.shuffle(seed=seed, buffer_size=STREAM_SHUFFLE_BUFFER)
    docs = split_dataset_by_node(docs, rank=dp_rank, world_size=dp_degree)
    return StreamingWindows(docs, tokenizer, seq_len, key)


def validation_windows(n_windows: int) -> int:
    """How many trailing windows are held out for validation when no validation path is set."""
    return min(max(int(n_windows * VAL_FRACTION), VAL_MIN_WINDOWS), n_windows // 10)


def build_dataloader(
    training_cfg: Training,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_degree: int,
    device: torch.device | str,
    dump_folder: str,
    global_batch_size: int,
    split: str = "train",
    dataset_path: str | None = None,
) -> TokenDataLoader:
    """The loader for `split` ("train" or "validation"); tokens are cached in <dump_folder>/.cache/data.

    Without `dataset_path`, the last `validation_windows(n)` windows of the training data
    are the validation split and are always left out of the training split, so the
    training stream is the same whether validation is on or off.
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    t = training_cfg
    global_bs = global_batch_size
    if dataset_path:
        key = "validation.dataset_path" if split == "validation" else "training.dataset_path"
        source, held_out = dataset_path, False
    elif t.dataset_path:
        key, source, held_out = "training.dataset_path", t.dataset_path, True
    else:
        key, source, held_out = "training.dataset", t.dataset, True
    loader_args = dict(seq_len=t.seq_len, global_batch_size=global_bs, local_batch_size=t.local_batch_size,
                       dp_rank=dp_rank, dp_degree=dp_degree, seed=t.seed, device=device)

    if source != "stdlib" and not _is_local(source):
        stream = _stream_hub(source, split, key, tokenizer, t.seq_len, t.seed, dp_rank, dp_degree)
        return TokenDataLoader(stream, **loader_args)

    cache_dir = os.path.join(dump_folder, ".cache", "data")
    tokens = _local_rank_zero_first(lambda: load_token_stream(source, tokenizer, cache_dir, key=key))
    windows = PackedWindows(tokens, t.seq_len)
    if len(windows) == 0:
        raise ConfigError(
            f"{key} '{source}' holds {len(tokens)} tokens, fewer than one window of training.seq_len + 1 "
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
    return TokenDataLoader(windows, **loader_args)
