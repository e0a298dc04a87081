"""Model registry: what the trainer needs to build and parallelize a model family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn


class HFAdapter(Protocol):
    """A model family's Hugging Face `transformers` layout, bound to one model's args.

    Tensors pass through one at a time on export, and as a block of whole row groups of one
    tensor (a rank's shard, widened to whole groups) on load, so neither direction needs the
    whole model in one place. The trainer's export and initial load know nothing else of
    the family.
    """

    vocab_keys: frozenset[str]  # our names whose dim 0 is the (padded) vocabulary

    def hf_name(self, name: str) -> str:
        """The HF name our tensor `name` is exported as."""

    def hf_source(self, name: str, config: dict) -> str:
        """The HF tensor our `name` loads from, given the folder's config.json (ties included)."""

    def row_group(self, name: str) -> int:
        """Rows that move together between our layout and HF's (1: rows map one to one)."""

    def to_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Our layout -> HF's, for whole row groups of `name`."""

    def from_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """HF layout -> ours, for whole row groups of `name`; inverse of `to_hf`."""

    def hf_config(self, *, dtype: torch.dtype, vocab_size: int | None = None) -> dict:
        """config.json for the exported model (`vocab_size`: rows kept, default all)."""

    def config_problems(self, config: dict) -> tuple[list[str], list[str]]:
        """(errors, warnings) comparing a folder's config.json with this model."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    vocab_size: Callable[[int, int], int]  # (tokenizer size, requested or 0) -> embedding rows
    build_args: Callable[..., Any]  # (flavor, vocab_size=, max_seq_len=) -> args
    model_cls: Callable[[Any], nn.Module]
    root_tp_plan: Callable[[bool, bool], dict]  # (sequence_parallel, loss_parallel) -> plan
    block_tp_plan: Callable[[bool], dict]  # (sequence_parallel) -> plan
    tp_divisible_sizes: Callable[[Any], dict[str, int]]
    blocks: Callable[[nn.Module], nn.ModuleDict]
    head: Callable[[nn.Module], nn.Linear]  # the output projection; model(tokens, labels) calls it as head(h, labels)
    fsdp_units: Callable[[nn.Module], list]
    hf_adapter: Callable[[Any], HFAdapter]  # (model args, or their asdict() from a checkpoint) -> adapter
    # (args, parallel.memory.ActivationInputs, each block's checkpointing kind) -> ActivationBytes
    activation_bytes: Callable[[Any, Any, Sequence[str]], Any]


def get_model_spec(name: str) -> ModelSpec:
    if name == "llama3":
        from models.llama3 import spec

        return spec
    raise KeyError(name)


MODEL_NAMES = ("llama3",)
