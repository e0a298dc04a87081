"""FSDP2 (`fully_shard`) on the data-parallel mesh dim, with mixed precision.

This is the default data-parallel engine. It takes the units to shard from the model's spec
(embedding, each block, norm+head) so it knows nothing of a particular model; parameters that
tensor parallelism already made DTensors keep their tp placement and gain the dp one.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

FSDPUnit = Union[nn.Module, Sequence[nn.Module]]


def unit_modules(unit: FSDPUnit) -> list[nn.Module]:
    """The modules of a unit given as one module or as a group of them."""
    return list(unit) if isinstance(unit, (list, tuple)) else [unit]


def unit_of(units: Sequence[FSDPUnit]) -> Callable[[torch.Tensor], int]:
    """Maps a parameter to the index of the first of `units` that holds it; a parameter in
    none (one the model's plan left out) goes with the first unit."""
    owner: dict[int, int] = {}
    for index, unit in enumerate(units):
        for module in unit_modules(unit):
            for p in module.parameters():
                owner.setdefault(id(p), index)
    return lambda param: owner.get(id(param), 0)


RESHARD_POLICIES = ("default", "always", "never")


def apply_fsdp(
    model: nn.Module,
    units: Sequence[FSDPUnit],
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
) -> None:
    """Shard each unit, then the root (which picks up any parameter left over).

    reshard_after_forward: "default" frees each unit's gathered parameters after its forward
    except the last unit's (backward needs them straight away, so keeping them saves one
    all-gather); "always" / "never" apply to every unit, the root included.
    """
    # cast_forward_inputs=False: the default casts every floating input of a unit to
    # param_dtype, which turns the fp32 RoPE cos/sin table passed to each block into bf16. The
    # dp = 1 path and the graph engine cast parameters only; with this all three compute the
    # same bf16 numbers (tests/test_data_parallel.py).
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for index, unit in enumerate(units):
        is_last = index == len(units) - 1
        if reshard_after_forward == "default":
            reshard = not is_last
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(list(unit) if isinstance(unit, (list, tuple)) else unit,
                    mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward == "always")


def set_gradient_sync(model: nn.Module, *, reduce_scatter: bool, all_reduce: bool) -> None:
    """Whether the next backward reduces gradients: the reduce-scatter within the shard group,
    and (HSDP) the all-reduce across replicas. Skipping both accumulates unsharded gradients
    until a backward that syncs; skipping only the all-reduce keeps gradients sharded and
    still saves the cross-node traffic. A no-op on a model without a data-parallel wrapper."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(reduce_scatter)
        model.set_requires_all_reduce(all_reduce)
