"""Export a model in Hugging Face format: safetensors shards (+ index) and config.json.

The model family's adapter (`ModelSpec.hf_adapter`; for Llama, models/llama3/hf.py) names and
reorders each tensor and writes config.json; this module only streams tensors into files.

- Sharded as `save_pretrained` shards: tensors fill a file until the next one would pass
  `max_shard_bytes` (HF's default, 5 GB; a larger tensor gets a file of its own). One file is
  `model.safetensors`; several are `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json`, which maps every tensor to its file.
- Streamed: a sharded model is gathered one tensor at a time, and rank 0 holds at most one
  file's tensors in CPU memory, so a 70B export needs neither the model on one rank nor its
  size in RAM.
- Published whole: the files go into `<out_dir>.tmp` and are renamed into place at the end,
  so a crash leaves any previous export as it was.

Vocabulary: rows padded for TP are kept (HF `vocab_size` is then the padded size; the
tokenizer never emits those ids) unless `vocab_size` trims them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from models import HFAdapter
from trainer.checkpoint import FINGERPRINT

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' and huggingface_hub's "5GB"


@dataclass(frozen=True)
class _Entry:
    name: str  # ours
    hf_name: str
    numel: int  # as exported: after the vocab trim
    nbytes: int  # ... in the export dtype


def _plan_shards(entries: list[_Entry], max_shard_bytes: int) -> list[list[_Entry]]:
    """Group tensors, in order, into files of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[_Entry]] = []
    size = 0
    for entry in entries:
        if not shards or size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _shard_file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _exported_rows(adapter: HFAdapter, name: str, rows: int, vocab_size: int | None) -> int:
    if vocab_size is None or name not in adapter.vocab_keys:
        return rows
    if vocab_size > rows:
        raise ValueError(f"vocab_size {vocab_size} is larger than the model's {rows} rows of {name}")
    return vocab_size


def _to_hf_tensor(
    adapter: HFAdapter, name: str, tensor: torch.Tensor, *, dtype: torch.dtype, vocab_size: int | None = None
) -> torch.Tensor:
    """One full tensor of ours as HF stores it: reordered, vocab rows trimmed, cast, on the CPU."""
    t = adapter.to_hf(name, tensor.detach())
    t = t[: _exported_rows(adapter, name, t.shape[0], vocab_size)]
    if t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous()


def export_hf(
    state_dict: dict[str, torch.Tensor],
    adapter: HFAdapter,
    out_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write the HF folder of a model state dict: full tensors, or the DTensor shards of
    `get_model_state_dict` on a mesh, gathered one tensor at a time.

    Collective when distributed: call it on every rank; rank 0 writes.
    """
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    entries = []
    for name, t in state_dict.items():
        rows = _exported_rows(adapter, name, t.shape[0], vocab_size)
        numel = rows * t.shape[1:].numel()
        entries.append(_Entry(name, adapter.hf_name(name), numel, numel * dtype.itemsize))
    shards = _plan_shards(entries, max_shard_bytes)
    files = _shard_file_names(len(shards))

    out_dir = os.path.normpath(out_dir)
    tmp = out_dir + ".tmp"
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed export
        os.makedirs(tmp)
    for file, shard in zip(files, shards):
        tensors = {}
        for entry in shard:
            t = state_dict[entry.name]
            full = t.full_tensor() if isinstance(t, DTensor) else t  # every rank, in the same order
            if writer:
                tensors[entry.hf_name] = _to_hf_tensor(adapter, entry.name, full, dtype=dtype, vocab_size=vocab_size)
            del full
        if writer:
            save_file(tensors, os.path.join(tmp, file), metadata={"format": "pt"})
    if not writer:
        return
    if len(files) > 1:
        index = {
            "metadata": {"total_parameters": sum(e.numel for e in entries),
                         "total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.hf_name: file for file, shard in zip(files, shards) for e in shard},
        }
        with open(os.path.join(tmp, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
        json.dump(adapter.hf_config(dtype=dtype, vocab_size=vocab_size), f, indent=2)
    _publish(tmp, out_dir)
    logger.info(f"exported {len(entries)} tensors in {len(files)} safetensors file(s) to {out_dir}")


def _publish(tmp: str, out_dir: str) -> None:
    """Replace `out_dir` by `tmp`; the previous export stays whole until the new one is."""
    old = out_dir + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.isdir(out_dir):
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def foreign_files(out_dir: str) -> list[str]:
    """Files in `out_dir` that an export did not write (an export replaces the whole folder)."""
    if not os.path.isdir(out_dir):
        return []
    ours = {INDEX_FILE, CONFIG_FILE}
    return sorted(n for n in os.listdir(out_dir) if n not in ours and not n.endswith(".safetensors"))


def read_model_args(ckpt_dir: str) -> dict:
    """Model args stored in a checkpoint's fingerprint file ({} when none were given)."""
    with open(os.path.join(ckpt_dir, FINGERPRINT)) as f:
        return json.load(f).get("model_args") or {}
