"""The graph data-parallel engine: FSDP written as code the compiler traces.

FSDP2's all-gathers and reduce-scatters run in hooks that Dynamo never traces, so a compiled
model under `fully_shard` is one graph per block with the data-parallel traffic outside them.
This engine keeps FSDP2's state and does its communication inside the model's own forward:

- Storage: each parameter stays a DTensor sharded on dim 0 over `dp`, with the placement
  `fully_shard` gives it, e.g. `(_StridedShard(0, split_factor=tp), Shard(0))` on the
  (dp, tp) mesh for a column-wise TP weight, `(Shard(0), Shard(1))` for a row-wise one and
  `(Shard(0),)` on the dp mesh without TP. Optimizer, gradient clipping and DCP checkpoints
  see exactly what they see under FSDP2, so a checkpoint moves between engines and meshes.
- Use: reading `module.weight` returns the full weight (parallel/parameter_views.py):
  `redistribute` to Replicate on dp with `forward_dtype=param_dtype` (cast, then all-gather
  in the compute dtype) and `backward_dtype=reduce_dtype`, then the tp-local piece as a tp
  DTensor, as TP's modules expect. Its gradient flows back as `Partial("avg")` on dp: a
  reduce-scatter in `reduce_dtype` that averages over dp as FSDP2 does.
- Memory, reshard after forward: every node of a parameter gather is annotated with the
  index of its unit (embedding, a block, norm + head). A joint-graph pass marks the forward
  ones must-recompute, so the partitioner re-gathers in backward instead of keeping full
  parameters alive from forward to backward. The activation-checkpoint policies also leave
  collectives on the dp group to recompute (eager checkpointing), while still saving the
  sequence-parallel all-gathers on the tp group.
- Communication: an inductor post-grad pass merges each unit's all-gathers, and each unit's
  reduce-scatters, into one collective per unit and direction, and inductor's overlap
  scheduler (where the torch version has it) moves them to overlap compute.

It works eagerly too (every use all-gathers; without activation checkpointing the gathered
weights then live until backward), and under per-block compile (each block's graph holds
its own gathers). Private torch APIs it relies on are in parallel/torch_internals.py.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import CheckpointPolicy

from parallel import torch_internals
from parallel.activation_checkpoint import recompute_collectives_on
from parallel.fsdp import unit_modules
from parallel.parameter_views import ParameterView, install_parameter_views, modules_with_parameters
from parallel.torch_internals import ALL_GATHER, REDUCE_SCATTER, _StridedShard

logger = logging.getLogger(__name__)

Unit = Union[nn.Module, Sequence[nn.Module]]

# node.meta["custom"] key naming the unit a parameter gather belongs to.
UNIT_KEY = "weft_dp_unit"
# Names of the process groups the engine shards over, to recognize its collectives in a graph.
_DP_GROUPS: set[str] = set()
_CODE_HASH = torch_internals.source_hash(__file__)


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel dim of a (dp, tp) mesh, whatever the caller named it."""
    return mesh[mesh.mesh_dim_names[0]]


def _stored_placements(param: torch.Tensor, mesh: DeviceMesh) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """FSDP2's mesh and placements for `param` (checked against fully_shard on torch 2.13)."""
    if not isinstance(param, DTensor):
        return _dp_mesh(mesh), (Shard(0),)
    if param.device_mesh.mesh_dim_names != ("tp",) or len(param.placements) != 1:
        raise ValueError(f"expected a parameter on the tp mesh, got {param.device_mesh} {param.placements}")
    tp_placement = param.placements[0]
    if isinstance(tp_placement, Shard) and tp_placement.dim == 0:
        dp_placement = _StridedShard(0, split_factor=param.device_mesh.size())
    else:
        dp_placement = Shard(0)
    return mesh, (dp_placement, tp_placement)


def _shard(param: nn.Parameter, target: DeviceMesh, placements: tuple[Placement, ...]) -> nn.Parameter:
    """`param` re-laid out on `target`: from its meta shape without any data, else from its values."""
    if param.device.type == "meta":
        full = torch.empty(param.shape, dtype=param.dtype, device="meta")
    else:
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    sharded = distribute_tensor(full, target, placements, src_data_rank=None)
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def _gather_view(stored: DTensor, unit: int, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> ParameterView:
    """The function that turns the stored shard into the weight used in compute."""
    mesh, placements = stored.device_mesh, stored.placements
    tp_placements = placements[1:]
    tp_mesh = mesh["tp"] if tp_placements else None
    gathered = (Replicate(), *tp_placements)
    grad_placements = (Partial("avg"), *tp_placements)
    forward_dtype = None if param_dtype == stored.dtype else param_dtype
    backward_dtype = None if reduce_dtype == param_dtype else reduce_dtype

    def view(shard: torch.Tensor) -> torch.Tensor:
        with torch_internals.annotate(UNIT_KEY, unit):
            full = shard.redistribute(mesh, gathered, forward_dtype=forward_dtype, backward_dtype=backward_dtype)
            local = full.to_local(grad_placements=grad_placements)
            if tp_mesh is None:
                return local
            return DTensor.from_local(local, tp_mesh, tp_placements, run_check=False)

    return view


def _unit_index(model: nn.Module, units: Sequence[Unit]) -> dict[nn.Module, int]:
    """Module -> index of the unit that holds it; modules outside every unit form one last unit."""
    index: dict[nn.Module, int] = {}
    for i, unit in enumerate(units):
        for top in unit_modules(unit):
            for module in top.modules():
                index.setdefault(module, i)
    for module in model.modules():
        index.setdefault(module, len(units))
    return index


def apply_graph_data_parallel(
    model: nn.Module,
    units: Sequence[Unit],
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
) -> None:
    """Shard every parameter over the data-parallel dim of `mesh` (a (dp, tp) mesh: dim 0 is data
    parallel, dim 1 is "tp") and gather it where it is used (see module doc).

    reshard_after_forward "never" keeps gathered parameters from forward to backward in
    compiled graphs (no re-gather); "default" and "always" re-gather every unit in backward.
    """
    if reduce_dtype != param_dtype and torch.__version__.startswith("2.12."):
        logger.warning(
            "torch 2.12 ignores DTensor.redistribute(backward_dtype=...): the graph engine's gradients "
            "are reduce-scattered in %s, not training.mixed_precision_reduce=%s (fixed in 2.13)",
            param_dtype, reduce_dtype,
        )
    unit_of = _unit_index(model, units)
    for module in list(modules_with_parameters(model)):
        views = {}
        for name, param in module._parameters.items():
            if param is None:
                continue
            target, placements = _stored_placements(param, mesh)
            stored = _shard(param, target, placements)
            module._parameters[name] = stored
            views[name] = _gather_view(stored, unit_of[module], param_dtype, reduce_dtype)
        install_parameter_views(module, views)
    dp_group = _dp_mesh(mesh).get_group().group_name
    _DP_GROUPS.add(dp_group)
    recompute_collectives_on(dp_group)
    if reshard_after_forward != "never":
        torch_internals.install_joint_pass(reshard_after_forward_pass)
    torch_internals.install_post_grad_pass(_BUCKETING_PASS)
    torch_internals.enable_overlap_scheduling(mesh.device_type)


# ---- graph passes -------------------------------------------------------------------------


def _backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on an incoming gradient (a `tangents_*` input)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            arg in backward for arg in node.all_input_nodes
        ):
            backward.add(node)
    return backward


def parameter_derived(graph: fx.Graph, exclude: set[fx.Node] = frozenset()) -> set[fx.Node]:
    """Nodes computed from parameter gathers alone: the annotated gather nodes, and every node
    (outside `exclude`) whose inputs all are such nodes, e.g. `weight.t()` or `weight.float()`."""
    derived: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node in exclude:
            continue
        inputs = node.all_input_nodes
        if torch_internals.annotation(node, UNIT_KEY) is not None or (inputs and all(n in derived for n in inputs)):
            derived.add(node)
    return derived


def _check_annotated(graph: fx.Graph) -> None:
    """Warn (once) if a dp collective lost its unit annotation: then it is neither resharded nor
    bucketed. That happens on a torch whose Dynamo does not carry `fx.traceback.annotate`
    into the graph (checked working on 2.13; not run on 2.11)."""
    if _check_annotated.warned:
        return
    for node in graph.nodes:
        if (
            node.op == "call_function"
            and node.target in (ALL_GATHER, REDUCE_SCATTER)
            and str(node.args[-1]) in _DP_GROUPS
            and torch_internals.annotation(node, UNIT_KEY) is None
        ):
            _check_annotated.warned = True
            logger.warning(
                "graph data-parallel engine: a data-parallel %s in the compiled graph carries no unit "
                "annotation on torch %s; it is not resharded after forward nor bucketed",
                node.target, torch.__version__,
            )
            return


_check_annotated.warned = False


def reshard_after_forward_pass(gm: fx.GraphModule, joint_inputs: object) -> fx.GraphModule:
    """Joint-graph pass: everything the forward computes from parameter gathers alone (the
    cast, the all-gather, its wait, re-layouts, transposes) is recomputed in backward instead
    of saved, which is FSDP2's reshard-after-forward. Activation-checkpoint policies may have
    tagged the all-gather must-save (they save sequence-parallel all-gathers); this tag
    overrides that for parameter gathers only."""
    _check_annotated(gm.graph)
    for node in parameter_derived(gm.graph, exclude=_backward_nodes(gm.graph)):
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return gm


reshard_after_forward_pass.cache_hash = f"weft-reshard-{_CODE_HASH}"


def unit_buckets(graph: fx.Graph, target: object) -> dict[tuple, list[fx.Node]]:
    """This graph's parameter collectives of one kind, grouped by (unit, group, dtype)."""
    buckets: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not target:
            continue
        unit = torch_internals.annotation(node, UNIT_KEY)
        if unit is None:
            continue
        key = (unit, str(node.args[-1]), node.meta["val"].dtype)
        buckets.setdefault(key, []).append(node)
    return buckets


def bucket_per_unit(graph: fx.Graph) -> None:
    """Post-grad pass: one all-gather and one reduce-scatter per unit instead of one per parameter.
    The merged nodes keep the unit annotation, so the graph still tells which unit each is."""
    buckets = [
        (nodes, {UNIT_KEY: key[0]})
        for target in (ALL_GATHER, REDUCE_SCATTER)
        for key, nodes in unit_buckets(graph, target).items()
        if len(nodes) > 1
    ]
    if buckets:
        torch_internals.merge_collectives(graph, buckets)


_BUCKETING_PASS = torch_internals.make_post_grad_pass(bucket_per_unit, uuid=f"weft-bucket-per-unit-{_CODE_HASH}")
