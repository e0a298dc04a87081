"""Gradient clipping by the true global norm over every mesh dim."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

TensorNorms = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def fp64_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each grad's L2 norm accumulated in fp64, in one multi-tensor kernel on CUDA.

    fp64 because a CPU fp32 norm over a 6M-element grad is off by ~3e-6 relative, enough to
    hide real parity bugs. `torch._foreach_norm` is private, but it is what the public
    `torch.nn.utils.get_total_norm` runs, and unlike it takes the accumulation dtype
    (`dtype=` since torch 2.4, pytorch#125665; checked on 2.13). DTensor grads dispatch it
    to the local shards and return norms pending a reduction over the sharded mesh dims.
    On CUDA one multi-tensor launch, accumulating in the output dtype (ForeachReduceOp.cu),
    replaces one reduction per parameter (258 of them at 3B).
    """
    return list(torch._foreach_norm(grads, 2.0, dtype=torch.float64))


def _mesh(tensor: torch.Tensor) -> object:
    return tensor.device_mesh if isinstance(tensor, DTensor) else None


def _grouped(items: Iterable, key: Callable) -> list[list]:
    groups: dict[object, list] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return list(groups.values())


def norm_groups(grads: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`grads` grouped as `global_norm` takes their norms: by mesh and by dtype."""
    return _grouped(grads, lambda grad: (_mesh(grad), grad.dtype))


@torch.no_grad()
def global_norm(grads: Iterable[torch.Tensor], tensor_norms: TensorNorms = fp64_norms) -> torch.Tensor:
    """The total L2 norm of `grads` (a plain fp32 tensor, equal on every rank).

    With FSDP2 and TP the grads are DTensors sharded over dp and tp; a group's norm is a
    DTensor with Partial placements, so `full_tensor()` reduces it across the mesh to what a
    single process computes on unsharded grads. Grads live on different meshes when some
    params are only dp-sharded (e.g. norms without sequence parallel), so each mesh's group is
    reduced on its own and the group norms are combined. Grads may mix dtypes (fp32, and bf16
    ones held by parallel/compact_gradients.py): grouped by dtype too, since the one-launch
    CUDA kernel takes one input dtype (mixed lists fall back to a norm per tensor).
    `tensor_norms` gives each group's per-tensor norms: `fp64_norms`, or the ones
    parallel/backward_grad_norms.py took during backward.
    """
    group_norms = []
    for group in norm_groups(grads):
        norm = torch.linalg.vector_norm(torch.stack(tensor_norms(group)))
        group_norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return torch.linalg.vector_norm(torch.stack(group_norms)).float()


@torch.no_grad()
def clip_grads_(parameters: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None = None) -> None:
    """Scale the parameters' grads in place so that `total` (their global norm) becomes at most `max_norm`.

    Grads on different meshes go through `clip_grads_with_norm_` one mesh at a time: its
    foreach kernel takes all plain tensors or all DTensors of one mesh.
    """
    for group in _grouped(parameters, lambda p: _mesh(p.grad)):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, foreach: bool | None = None) -> torch.Tensor:
    """Clip in place and return the total L2 norm (`global_norm`); `max_norm <= 0` only measures."""
    params = [p for p in parameters if p.grad is not None]
    total = global_norm(p.grad for p in params)
    if max_norm > 0:
        clip_grads_(params, max_norm, total, foreach=foreach)
    return total
