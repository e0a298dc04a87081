"""Data parallelism: one entry point for both engines, and the dp = 1 path that uses neither.

Engines (`[parallelism] data_parallel_engine`):
- "fully_shard": FSDP2 (parallel/fsdp.py), or HSDP with a replicate dim. Its hooks run eagerly,
  outside any compiled graph.
- "graph": parameters stay dp-sharded DTensors and are all-gathered where they are used, in
  code the compiler traces (parallel/graph_data_parallel.py), so whole-model compile yields one
  graph with the data-parallel collectives inside it.
- "auto": "graph" under whole-model compile, "fully_shard" otherwise.

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
from torch.distributed.tensor import DTensor, Replicate

from parallel.compact_gradients import CompactGradients, cast_into_sink
from parallel.fsdp import FSDPUnit, apply_fsdp
from parallel.graph_data_parallel import apply_graph_data_parallel
from parallel.mesh import Meshes
from parallel.parameter_views import has_parameter_views, install_parameter_views, modules_with_parameters

ENGINES = ("auto", "fully_shard", "graph")


def resolve_engine(engine: str, *, whole_model_compile: bool) -> str:
    """The engine "auto" stands for: "graph" when the whole model is compiled, else "fully_shard"."""
    if engine not in ENGINES:
        raise ValueError(f"parallelism.data_parallel_engine must be one of {', '.join(ENGINES)}; got {engine!r}.")
    if engine == "auto":
        return "graph" if whole_model_compile else "fully_shard"
    return engine


def traceable(engine: str, dp: int) -> bool:
    """Whether the compiler can trace the data-parallel work, i.e. the whole model can be one graph."""
    return dp == 1 or engine == "graph"


def describe(engine: str, requested: str, dp: int) -> str:
    """One line for the log: what runs, and why."""
    if dp == 1:
        return "none (dp = 1: fp32 parameters cast to the compute dtype at use)"
    return f"{engine} (auto)" if requested == "auto" else engine


class CastView:
    """The parameter view of dp = 1: the stored fp32 parameter cast to the compute dtype at use
    (for a tp-replicated DTensor, its local tensor). One per parameter, so that its gradient
    can be routed into the parameter's own sink (`compact_gradients`), or, where the sink is a
    kept compute-dtype copy of the parameter, read from it without a cast."""

    def __init__(self, dtype: torch.dtype, local: bool) -> None:
        self.dtype, self.local = dtype, local
        self.sink: torch.Tensor | None = None
        self.sink_is_copy = False

    def __call__(self, stored: torch.Tensor) -> torch.Tensor:
        if self.sink is not None:
            return self.sink if self.sink_is_copy else cast_into_sink(stored, self.sink)
        cast = stored.to(self.dtype)
        return cast.to_local() if self.local else cast


def _cast_output(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(dtype)

    return hook


def apply_compute_dtype(model: nn.Module, param_dtype: torch.dtype, tp_mesh: DeviceMesh | None = None) -> None:
    """dp = 1: every parameter is read as a cast to `param_dtype`; no data-parallel wrapper.

    An `nn.Embedding` (a table not sharded by tensor parallel) instead looks its rows up in
    fp32 and casts what it returns, as autocast does: the forward is the same bits (a cast
    commutes with a row gather), and backward scatters the gradient straight into the fp32
    table gradient. Cast first, the table would exist twice more in `param_dtype`, once in
    forward and once as its gradient at the very end of backward, where every other gradient
    is already alive: that is the step's peak whenever activations are small (8B with full AC
    on one H200, torch 2.11: max active 120.7 -> 120.0 GiB, reserved 122.7 -> 121.8 GiB).
    Rows that share a token now sum in fp32, not bf16.

    With tensor parallel (`tp_mesh`), a parameter TP left a plain tensor (a norm weight without
    sequence parallel) is stored as a tp-replicated DTensor and read as its local tensor, as
    before: the optimizer's foreach kernels and gradient clipping take either all plain tensors
    or all DTensors, not a mix.
    """
    for module in modules_with_parameters(model):
        if tp_mesh is None and isinstance(module, nn.Embedding):
            module.register_forward_hook(_cast_output(param_dtype))
            continue
        views = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            if tp_mesh is not None and not isinstance(param, DTensor):
                replicated = DTensor.from_local(param.detach(), tp_mesh, [Replicate()], run_check=False)
                module._parameters[name] = nn.Parameter(replicated, requires_grad=param.requires_grad)
                views[name] = CastView(param_dtype, local=True)
            else:
                views[name] = CastView(param_dtype, local=False)
        install_parameter_views(module, views)


def cast_views(model: nn.Module) -> list[tuple[nn.Parameter, CastView]]:
    """The parameters `apply_compute_dtype` reads through a cast, with their views."""
    return [
        (module._parameters[name], view)
        for module in modules_with_parameters(model)
        if has_parameter_views(module)
        for name, view in module._parameter_views.items()
        if isinstance(view, CastView)
    ]


def compact_gradients(model: nn.Module, param_dtype: torch.dtype, keep_copies: bool = False) -> CompactGradients:
    """dp = tp = 1: send the gradient of every cast-at-use parameter, in `param_dtype`, to a sink
    that holds it until the optimizer step (parallel/compact_gradients.py). With `keep_copies`
    the sinks are the parameters' compute-dtype copies, which forward reads instead of casting;
    call `refresh_copies()` before each forward."""
    pairs = cast_views(model)
    if any(view.local or isinstance(p, DTensor) for p, view in pairs):
        raise ValueError("compact gradients need plain tensors (no tensor parallel)")
    compact = CompactGradients([p for p, _ in pairs], param_dtype, keep_copies)
    for p, view in pairs:
        view.sink = compact.sinks.get(p)
        view.sink_is_copy = keep_copies and view.sink is not None
    return compact


def apply_data_parallel(
    model: nn.Module,
    units: Sequence[FSDPUnit],
    meshes: Meshes,
    *,
    engine: str,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
) -> None:
    """Apply data parallelism over `meshes.data_parallel` with a resolved engine ("fully_shard" | "graph").

    `units` are the groups that share one all-gather / reduce-scatter (the embedding, each
    block, norm + head). Apply before weights are materialized and initialized; initialize
    inside `parallel.parameter_views.stored_parameters()`.
    """
    if engine not in ENGINES[1:]:
        raise ValueError(f"apply_data_parallel needs a resolved engine (fully_shard or graph), got {engine!r}")
    if meshes.data_parallel.size() == 1:
        apply_compute_dtype(model, param_dtype, meshes.tp if meshes.tp.size() > 1 else None)
    elif engine == "fully_shard":
        apply_fsdp(model, units, meshes.data_parallel, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   reshard_after_forward=reshard_after_forward)
    elif meshes.data_parallel.ndim > 1:
        raise ValueError("the graph engine shards over one data-parallel dim; HSDP (a replicate dim) needs fully_shard")
    else:
        apply_graph_data_parallel(model, units, meshes.world["dp_shard", "tp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                  reshard_after_forward=reshard_after_forward)
