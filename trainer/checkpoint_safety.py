"""Reading a DCP checkpoint without running any code stored in it.

torch.distributed.checkpoint (DCP) unpickles two things from a checkpoint folder with plain
pickle, which runs whatever callables the pickle names:

- `.metadata`: `FileSystemReader.read_metadata` calls `pickle.load`.
- every non-tensor item (the optimizer's `param_groups` values, for one):
  `DefaultLoadPlanner.load_bytes` calls `torch.load(..., weights_only=False)`.

Both are the case on torch 2.11 and 2.13 (checked in the installed 2.13 source and in
pytorch's default_planner.py / filesystem.py of earlier 2.x releases; the tensor items
themselves are already read with `weights_only=True`). So a checkpoint folder from
someone else could run a command on resume or in `scripts/convert_to_hf.py`.
`safe_dcp_load` replaces those two steps:

- `SafeFileSystemReader` unpickles `.metadata` with an allow-list: DCP's metadata
  classes, torch sizes, dtypes and layouts, paths, and plain builtins. It also refuses
  storage entries that point outside the checkpoint folder.
- `WeightsOnlyLoadPlanner` loads every non-tensor item with `torch.load(weights_only=True)`.

Anything refused raises `CheckpointReadError`, one line naming the file. So do a missing
or garbage `.metadata` and any other failure inside DCP. `.metadata` is read and checked
up front, on every rank, before DCP runs: when DCP's own read fails, its loader
(`state_dict_loader.py`, torch 2.11-2.13) logs the error with a traceback on the root
logger, tries a per-rank `__<rank>.metadata`, and logs a second traceback. Reading it first
means DCP only ever gets the cached, valid metadata.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem
from torch.serialization import _get_layout

METADATA = ".metadata"


class CheckpointReadError(Exception):
    """A checkpoint file that cannot be read, or that was refused; the message names it."""


# `_StorageInfo` (DCP's per-item file/offset record) and `torch.serialization._get_layout`
# (how a torch.layout pickles) are private, but they are what `.metadata` holds on
# torch 2.11-2.13; every other allowed name is public.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, name): getattr(dcp_metadata, name) for name in (
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING",
    ) if hasattr(dcp_metadata, name)},
    (_StorageInfo.__module__, "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _get_layout,
    **{("pathlib", cls.__name__): cls for cls in (
        pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)},
    **{("builtins", cls.__name__): cls for cls in (
        dict, list, tuple, set, frozenset, int, float, complex, bool, str, bytes, bytearray, slice)},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the names in `_ALLOWED` and torch dtypes; every other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def _check_metadata(md: Any) -> None:
    if not isinstance(md, dcp_metadata.Metadata) or not isinstance(md.storage_data, dict):
        raise pickle.UnpicklingError(f"holds a {type(md).__name__}, not DCP metadata")
    for info in md.storage_data.values():
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or rel in ("", ".", ".."):
            raise pickle.UnpicklingError(f"points to {rel!r}, outside the checkpoint folder")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through the allow-list unpickler.

    The metadata is read once and cached: `safe_dcp_load` reads it before calling DCP,
    so a bad file fails here in one line instead of inside DCP's fallback path.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._metadata: dcp_metadata.Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if self._metadata is None:
            file = os.path.join(self.path, METADATA)
            try:
                with open(file, "rb") as f:
                    md = _MetadataUnpickler(f).load()
                _check_metadata(md)
            except FileNotFoundError:
                raise CheckpointReadError(f"checkpoint file {file} is missing") from None
            except Exception as e:
                raise CheckpointReadError(f"checkpoint file {file} is refused or corrupt ({_reason(e)})") from None
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            self._metadata = md
        return self._metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with `torch.load(weights_only=True)`.

    The parent (torch 2.11-2.13) uses `weights_only=False` here. Its state dict is always
    flattened (the default), so `self.mappings` gives each item's path in the nested state
    dict the caller passed; every container on that path exists, since the flat key was
    made from that very dict.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            file = os.path.join(self.path, info.relative_path if info is not None else "?")
            raise CheckpointReadError(
                f"checkpoint file {file}: item {read_item.dest_index.fqn} is refused ({_reason(e)})"
            ) from None
        *parents, last = self.mappings[read_item.dest_index.fqn]
        container: Any = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = obj


def _reason(e: BaseException) -> str:
    """A short reason, without torch's advice to retry with weights_only=False."""
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1].strip().split("\n\n")[0]
        return "not plain data: " + text.splitlines()[0].strip() if text else "not plain data"
    text = text.strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def iter_causes(e: BaseException) -> Iterator[BaseException]:
    """`e` and every exception inside it: causes, contexts and DCP's per-rank failures."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        if isinstance(cur, dcp.CheckpointException):
            for failure in cur.failures.values():
                stack.append(failure[0] if isinstance(failure, tuple) else failure)
        stack += [cur.__cause__, cur.__context__]


def root_cause(e: BaseException) -> str:
    """One line naming the first rank's error inside DCP's CheckpointException."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, failure = next(iter(e.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {root_cause(inner)}"
    return _reason(e)


def _raise_if_any_failed(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank failed, so no rank enters DCP's collectives alone."""
    errors = [error]
    if group is not None:
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointReadError(first)


def safe_dcp_load(state: dict[str, Any], path: str, process_group: dist.ProcessGroup | None = None) -> None:
    """`dcp.load(state)` from folder `path`, running no code from it. Collective over `process_group`.

    Pass `process_group=None` to load on one process without a process group (offline tools).
    Raises CheckpointReadError with one line naming the file on any failure.
    """
    reader = SafeFileSystemReader(path)
    error = None
    try:
        reader.read_metadata()
    except CheckpointReadError as e:
        error = str(e)
    _raise_if_any_failed(error, process_group)
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(path),
                 process_group=process_group, no_dist=process_group is None)
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        refused = next((c for c in iter_causes(e) if isinstance(c, CheckpointReadError)), None)
        if refused is not None:
            raise CheckpointReadError(str(refused)) from None
        raise CheckpointReadError(f"checkpoint {path} is unreadable ({root_cause(e)})") from None


def load_model_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The unsharded model weights of a checkpoint folder, on one process, no process group needed."""
    md = SafeFileSystemReader(path).read_metadata()
    model_sd = {
        key.removeprefix("model."): torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in md.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, dcp_metadata.TensorStorageMetadata)
    }
    if not model_sd:
        raise CheckpointReadError(f"checkpoint {path} holds no model tensors (not a weft checkpoint?)")
    safe_dcp_load({"model": model_sd}, path)
    return model_sd
