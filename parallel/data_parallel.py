"""Data parallelism: FSDP2 (or HSDP) over the data-parallel mesh, and the dp = 1 path that uses no wrapper.

At dp = 1 (one GPU, or pure tensor parallel) no data-parallel wrapper is applied: there is
nothing to shard or reduce, and FSDP2 on a one-rank mesh still pays for its copy-in/copy-out
buffers and a side-stream reduce-scatter of the whole fp32 gradient (docs/performance.md).
Parameters stay fp32 master weights (plain tensors, or tp DTensors) and each is cast to the
compute dtype where it is used. Those are FSDP2's mixed-precision numerics: forward and
backward in `param_dtype`, the gradient arriving in fp32 on the fp32 parameter (at dp = 1
there is no reduction, so `reduce_dtype` has nothing to act on). Every path keeps the same
parameter names and global shapes, so checkpoints move between them.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.fsdp import FSDPUnit, apply_fsdp
from parallel.parameter_views import install_parameter_views, modules_with_parameters


def _cast_to(dtype: torch.dtype):
    def view(stored: torch.Tensor) -> torch.Tensor:
        return stored.to(dtype)

    return view


def apply_compute_dtype(model: nn.Module, param_dtype: torch.dtype) -> None:
    """dp = 1: every parameter is read as a cast to `param_dtype`; no data-parallel wrapper."""
    view = _cast_to(param_dtype)
    for module in modules_with_parameters(model):
        install_parameter_views(module, {name: view for name, p in module._parameters.items() if p is not None})


def apply_data_parallel(
    model: nn.Module,
    units: Sequence[FSDPUnit],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
) -> None:
    """Apply data parallelism over `mesh`: the data-parallel mesh (dp_shard, or (dp_replicate,
    dp_shard) for HSDP).

    `units` are the groups that share one all-gather / reduce-scatter (the embedding, each
    block, norm + head). Apply before weights are materialized and initialized; initialize
    inside `parallel.parameter_views.stored_parameters()`.
    """
    if mesh.size() == 1:
        apply_compute_dtype(model, param_dtype)
    else:
        apply_fsdp(model, units, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward)
