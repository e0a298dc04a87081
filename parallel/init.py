"""Mesh-independent parameter initialization.

Every rank draws each parameter's FULL tensor from the same seeded RNG stream, in the model's
own order, and keeps only its shard. The values are then identical to a single-process run
whatever the mesh (dp x tp), at the cost of generating one full parameter at a time; that is
what lets a 2x2 run be checked against a 1x1 run step for step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


@torch.no_grad()
def sharded_init_normal_(param: torch.Tensor, std: float, bound: float | None) -> None:
    """Fill `param` (plain or DTensor) with N(0, std), truncated at +-bound if given."""
    if not isinstance(param, DTensor):
        _fill_normal(param, std, bound)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    _fill_normal(full, std, bound)
    shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    param.to_local().copy_(shard.to_local())


def _fill_normal(tensor: torch.Tensor, std: float, bound: float | None) -> None:
    if bound is None:
        nn.init.normal_(tensor, mean=0.0, std=std)
    else:
        nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-bound, b=bound)
