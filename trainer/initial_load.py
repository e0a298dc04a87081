"""Start a run from Hugging Face weights (torchtitan's `checkpoint.initial_load_*` keys).

Used only when there is no checkpoint to resume: a resume always wins. Each rank reads only
the rows and columns of its own shards, straight from the safetensors files
(`safe_open(...).get_slice`), so a 70B load never holds the full model on one rank. The
model family's adapter names each tensor and reorders HF rows into ours; a reordering (the
RoPE row permutation of wq/wk) never crosses a row group (a head), so a shard is read
widened to whole groups, reordered, and cut back.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from models import HFAdapter
from trainer.checkpoint import CheckpointError
from trainer.config import ConfigError
from trainer.export import CONFIG_FILE, INDEX_FILE

logger = logging.getLogger(__name__)


def resolve_initial_load(path: str, in_hf: bool, model_only: bool) -> str | None:
    """The Hugging Face folder to start from, or None; ConfigError for what weft does not support."""
    if not path:
        if in_hf:
            raise ConfigError(
                "checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_path: "
                "the folder of a Hugging Face model (*.safetensors and config.json)."
            )
        return None
    if not in_hf:
        raise ConfigError(
            f"checkpoint.initial_load_path = '{path}' without checkpoint.initial_load_in_hf = true names a "
            "DCP checkpoint, and weft starts only from Hugging Face safetensors. Set "
            "checkpoint.initial_load_in_hf = true for a Hugging Face folder; to continue a weft run, "
            "copy its step-N folder into checkpoint.folder instead."
        )
    if not model_only:
        raise ConfigError(
            "checkpoint.initial_load_model_only = false: Hugging Face weights hold no optimizer, "
            "scheduler or data state. Leave it true (the default)."
        )
    return path


@dataclass(frozen=True)
class HFTensorInfo:
    file: str
    shape: tuple[int, ...]


def scan_hf_folder(folder: str) -> tuple[dict[str, HFTensorInfo], dict]:
    """Every tensor's file and shape (from the safetensors headers only) and config.json ({} if absent)."""
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint.initial_load_path '{folder}' is not a folder.")
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(
            f"checkpoint.initial_load_path '{folder}' holds no *.safetensors files; "
            "point it at a Hugging Face model folder."
        )
    tensors: dict[str, HFTensorInfo] = {}
    for name in names:
        file = os.path.join(folder, name)
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    if key in tensors:
                        raise CheckpointError(f"tensor {key} is in both {tensors[key].file} and {file}.")
                    tensors[key] = HFTensorInfo(file, tuple(f.get_slice(key).get_shape()))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}).") from e
    config: dict = {}
    config_path = os.path.join(folder, CONFIG_FILE)
    if os.path.isfile(config_path):
        with open(config_path) as f:
            config = json.load(f)
    return tensors, config


def _shape_problem(
    name: str, hf_shape: tuple[int, ...], ours: tuple[int, ...], used_rows: int | None
) -> str | None:
    """None when the HF tensor fits ours; `used_rows`: of a vocabulary tensor, the rows the tokenizer uses."""
    if hf_shape == ours:
        return None
    if used_rows is not None and hf_shape[1:] == ours[1:] and used_rows <= hf_shape[0] < ours[0]:
        return None  # our vocabulary is padded past the tokenizer; the missing rows start at zero
    return f"{name}: {list(hf_shape)} in the checkpoint, {list(ours)} in this model"


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """This rank's tensor and the (offsets, sizes) box of the global tensor it holds."""
    if isinstance(t, DTensor):
        # DTensor's checkpoint protocol names the global box of the local shard for any
        # placements, FSDP2's strided shards over TP included. A dunder rather than a public
        # function, but it is what DCP's planner (`_create_chunk_list`) calls for every DTensor
        # it saves or loads, so weft's resharding checkpoints depend on it already (read in
        # torch 2.13's source; the 2x2 test exercises it).
        chunk = t.__create_chunk_list__()[0]
        return t.to_local(), tuple(chunk.offsets), tuple(chunk.sizes)
    return t, (0,) * t.dim(), tuple(t.shape)


def _read_shard(f, source: str, hf_rows: int, name: str, t: torch.Tensor, adapter: HFAdapter) -> None:
    """Copy the box of `name` this rank holds from HF tensor `source`, reading whole row groups."""
    local, offsets, sizes = _local_box(t)
    if local.numel() == 0:
        return
    group = adapter.row_group(name)
    begin, end = offsets[0], offsets[0] + sizes[0]
    lo, hi = begin // group * group, -(-end // group) * group
    cols = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    stored = min(hi, hf_rows) - lo
    parts = [f.get_slice(source)[(slice(lo, lo + stored), *cols)]] if stored > 0 else []
    if stored < hi - lo:  # padded vocabulary rows the checkpoint lacks
        parts.append(torch.zeros((hi - lo - max(stored, 0), *sizes[1:]), dtype=local.dtype))
    block = torch.cat([p.to(local.dtype) for p in parts]) if len(parts) > 1 else parts[0]
    local.copy_(adapter.from_hf(name, block)[begin - lo : end - lo])


@torch.no_grad()
def load_hf_weights(model: nn.Module, adapter: HFAdapter, folder: str, *, vocab_size: int) -> None:
    """Set every parameter of the (sharded) model from the HF folder; each rank reads its shards only.

    `vocab_size`: the tokenizer's; the checkpoint may lack only the padding rows past it.
    """
    started = time.monotonic()
    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    tensors, config = scan_hf_folder(folder)
    errors, warnings = adapter.config_problems(config)
    if errors:
        raise CheckpointError(
            f"{os.path.join(folder, CONFIG_FILE)} does not describe this model: {'; '.join(errors)}. "
            "Use the model flavor the checkpoint was trained as."
        )
    if rank0:
        for warning in warnings:
            logger.warning(f"{os.path.join(folder, CONFIG_FILE)}: {warning}; loading anyway")

    state_dict = get_model_state_dict(model)
    sources = {name: adapter.hf_source(name, config) for name in state_dict}
    missing = sorted(name for name, source in sources.items() if source not in tensors)
    if missing:
        raise CheckpointError(
            f"{folder} lacks {len(missing)} tensors this model needs (e.g. {sources[missing[0]]} for "
            f"{missing[0]}); is it a Hugging Face checkpoint of this model?"
        )
    problems = [p for name, t in state_dict.items() if (p := _shape_problem(
        sources[name], tensors[sources[name]].shape, tuple(t.shape),
        vocab_size if name in adapter.vocab_keys else None))]
    if problems:
        raise CheckpointError(
            f"{folder} holds a model of another shape: {len(problems)} tensors differ (e.g. {problems[0]}). "
            "Use the model flavor, and the tokenizer (model.tokenizer_path), the checkpoint was trained with."
        )

    by_file: dict[str, list[str]] = defaultdict(list)
    for name in state_dict:
        by_file[tensors[sources[name]].file].append(name)
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as f:
            for name in names:
                source = sources[name]
                _read_shard(f, source, tensors[source].shape[0], name, state_dict[name], adapter)
    set_model_state_dict(model, state_dict)

    if rank0:
        unused = sorted(tensors.keys() - set(sources.values()))
        if unused:
            logger.warning(f"{folder}: {len(unused)} tensors are not used by this model (e.g. {unused[0]})")
        logger.info(f"initialized the model from Hugging Face weights in {folder}: {len(state_dict)} tensors "
                    f"from {len(by_file)} file(s) in {time.monotonic() - started:.1f}s")
        for name in sorted(adapter.vocab_keys & state_dict.keys()):
            stored, ours = tensors[sources[name]].shape[0], state_dict[name].shape[0]
            if stored < ours:
                logger.info(f"{name}: rows {stored}..{ours - 1} (vocabulary padding) are not in the "
                            "checkpoint and start at zero")
