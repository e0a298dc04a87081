"""Model registry: what the trainer needs to build and parallelize a model family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


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
    fsdp_units: Callable[[nn.Module], list]


def get_model_spec(name: str) -> ModelSpec:
    if name == "llama3":
        from models.llama3 import spec

        return spec
    raise KeyError(name)


MODEL_NAMES = ("llama3",)
