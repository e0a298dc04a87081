"""Every private or unstable torch API the graph data-parallel engine, compile and the weight copies use.

The engine itself (parallel/graph_data_parallel.py) is written against public APIs: DTensor
`redistribute(forward_dtype=, backward_dtype=)`, `to_local(grad_placements=)`, `from_local`,
and `torch.utils.checkpoint.CheckpointPolicy`. What it needs beyond them is here, each with
the torch versions it was checked on. Checked in the torch 2.13 source and run on 2.13 CPU;
the GPU machine runs 2.11, where each helper that is missing degrades to "feature off" (no
bucketing, no overlap scheduling) rather than failing the run.

- `_StridedShard` (torch.distributed.tensor.placement_types; 2.11-2.14): the dp placement
  FSDP2 gives a parameter whose tp placement already shards dim 0. Matching it keeps
  checkpoints interchangeable and turns the dp all-gather into one collective.
- `torch.fx.traceback.annotate` (2.10+, "not backward compatible"): marks the nodes of each
  parameter all-gather with the unit (block) it belongs to. Dynamo keeps the mark on the
  forward nodes and AOTAutograd copies it to the backward nodes (checked on 2.13).
- `torch._functorch.config.joint_custom_pass` (2.11-2.14): called on the joint forward+backward
  graph before partitioning; the engine tags its gathers must-recompute there. The setting is
  left out of AOTAutograd's cache key (2.13), so the pass carries a `cache_hash` that
  parallel/compile.py adds to the key.
- `torch._inductor.fx_passes.bucketing.merge_all_gather` / `merge_reduce_scatter` and
  `torch._inductor.pattern_matcher.stable_topological_sort` (2.13): merge a list of
  collectives into one; used by the per-block bucketing pass below.
- `torch._inductor.config.post_grad_custom_post_pass` + `CustomGraphPass` (2.11-2.14): where
  inductor runs that pass; its `uuid()` is part of the FX graph cache key.
- `torch._inductor.config.aten_distributed_optimizations.enable_overlap_scheduling` (2.13):
  inductor's compute/communication overlap scheduler, GPU only. Its own size-based
  re-bucketing is turned off so the per-block buckets stay as they are. Not run here (no GPU).
- `torch._functorch.config.autograd_cache_allow_custom_autograd_functions` (2.11-2.13): lets
  AOTAutograd cache graphs that call a custom `torch.autograd.Function`.
- `InvokeSubgraphHOP.gen_schema` (torch._higher_order_ops.invoke_subgraph; 2.11-2.13) and
  `torch._guards.TracingContext.try_get`: memoized per compile for nested compile regions, see
  `memoize_nested_region_schemas`.
- `Tensor._version` (every torch since 0.4; checked on 2.11 and 2.13): the counter autograd
  bumps on each in-place write, documented in the autograd notes but underscored. The
  compute-dtype weight copies (parallel/compact_gradients.py) read it to find parameters
  written since they were copied, and the norms taken during backward
  (parallel/backward_grad_norms.py) to find gradients written after their norm; see
  `version_counter`.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from typing import Any, Callable

import torch
from torch import fx

# 2.11-2.14: the class lives here (torch.distributed.tensor.placement_types).
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: F401

ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


def source_hash(path: str) -> str:
    """A stable hash of a source file, for cache keys of passes defined in it."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


# ---- annotations --------------------------------------------------------------------------


_FX_ANNOTATE = getattr(torch.fx.traceback, "annotate", None)


def annotate(key: str, value: Any) -> contextlib.AbstractContextManager:
    """A context in which every traced FX node gets `node.meta["custom"][key] = value`.
    Eagerly, and on a torch without `torch.fx.traceback.annotate`, it does nothing."""
    if _FX_ANNOTATE is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _FX_ANNOTATE({key: value})


def annotation(node: fx.Node, key: str) -> Any:
    return (node.meta.get("custom") or {}).get(key)


# ---- AOTAutograd cache ---------------------------------------------------------------------


def cache_graphs_with_autograd_functions() -> None:
    """Let AOTAutograd's cache store graphs that call this project's `torch.autograd.Function`s.

    Dynamo traces a custom Function into the graph (its forward and backward as subgraphs of
    an `autograd_function_apply` node), and AOTAutograd refuses to cache such graphs unless
    `torch._functorch.config.autograd_cache_allow_custom_autograd_functions` is set (torch
    2.11 and 2.13; "Can't cache HigherOrderOperator"), so every warm start recompiled them: the compact
    gradients' cast (in every block) and the chunked loss functions. The traced subgraphs are
    part of the hashed graph, so the key changes with their code; ours keep no state outside
    the tensors they are given. A torch without the flag (older than the ones checked) keeps
    bypassing the cache for these graphs, as before.
    """
    import torch._functorch.config as config

    if hasattr(config, "autograd_cache_allow_custom_autograd_functions"):
        config.autograd_cache_allow_custom_autograd_functions = True


# ---- joint-graph pass (before the forward/backward partition) -----------------------------


def install_joint_pass(joint_pass: Callable[[fx.GraphModule, Any], fx.GraphModule]) -> None:
    """Run `joint_pass(joint_graph, joint_inputs)` on every joint graph AOTAutograd partitions.

    Any pass already installed keeps running first. Installing the same pass twice is a no-op.
    """
    config = torch._functorch.config
    current = config.joint_custom_pass
    if current is joint_pass or getattr(current, "wraps", None) is joint_pass:
        return
    if current is None:
        config.joint_custom_pass = joint_pass
        return

    def chained(gm: fx.GraphModule, joint_inputs: Any) -> fx.GraphModule:
        return joint_pass(current(gm, joint_inputs), joint_inputs)

    chained.wraps = joint_pass
    chained.cache_hash = f"{getattr(current, 'cache_hash', '?')}+{getattr(joint_pass, 'cache_hash', '?')}"
    config.joint_custom_pass = chained


def joint_pass_cache_hash() -> str:
    """What the installed joint pass contributes to the compile cache key ("" if none)."""
    current = torch._functorch.config.joint_custom_pass
    return "" if current is None else str(getattr(current, "cache_hash", repr(current)))


# ---- inductor post-grad passes --------------------------------------------------------------


def _custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def make_post_grad_pass(fn: Callable[[fx.Graph], None], uuid: str) -> Any:
    """A `CustomGraphPass` running `fn(graph)`, keyed in the FX graph cache by `uuid`."""
    base = _custom_graph_pass_base()

    class _Pass(base):  # type: ignore[misc, valid-type]
        def __call__(self, graph: fx.Graph) -> None:
            fn(graph)

        def uuid(self) -> str:
            return uuid

    return _Pass()


def install_post_grad_pass(graph_pass: Any) -> None:
    """Run `graph_pass` among inductor's post-grad passes (before its own bucketing)."""
    config = torch._inductor.config
    current = config.post_grad_custom_post_pass
    if current is None or getattr(current, "uuid", lambda: None)() == graph_pass.uuid():
        config.post_grad_custom_post_pass = graph_pass
        return
    raise RuntimeError(
        "torch._inductor.config.post_grad_custom_post_pass is already set; the graph data-parallel "
        "engine's bucketing pass would replace it"
    )


def merge_collectives(graph: fx.Graph, buckets: list[tuple[list[fx.Node], dict[str, Any]]]) -> bool:
    """Merge each bucket of all-gathers (or of reduce-scatters) into one collective and give
    every node the merge creates `meta["custom"]` entries from the bucket's dict. Returns False,
    changing nothing, on a torch without the merge helpers."""
    try:
        from torch._inductor.fx_passes.bucketing import merge_all_gather, merge_reduce_scatter
        from torch._inductor.pattern_matcher import stable_topological_sort
    except ImportError:
        return False
    gm = graph.owning_module
    for nodes, custom in buckets:
        before = set(graph.nodes)
        merge = merge_all_gather if nodes[0].target is ALL_GATHER else merge_reduce_scatter
        merge(gm, [nodes])
        for node in graph.nodes:
            if node not in before:
                node.meta["custom"] = {**(node.meta.get("custom") or {}), **custom}
    # A merged collective sits where its last input is ready; users of an earlier member may
    # now precede it, and a stable topological sort restores a valid order (as inductor's own
    # bucketing does).
    stable_topological_sort(graph)
    return True


def enable_overlap_scheduling(device_type: str) -> bool:
    """Turn on inductor's compute/communication overlap scheduler where this torch has it,
    keeping its own collective bucketing off. Returns whether it was turned on.

    GPU only: its cost model reads the GPU's memory bandwidth (through triton), and on a CPU
    build the pass fails with "No module named 'triton'" (torch 2.13)."""
    if device_type != "cuda":
        return False
    options = getattr(torch._inductor.config, "aten_distributed_optimizations", None)
    if options is None or not hasattr(options, "enable_overlap_scheduling"):
        return False
    options.enable_overlap_scheduling = True
    for name in ("collective_bucketing", "pre_bucketing_fsdp_collectives"):
        if hasattr(options, name):
            setattr(options, name, False)
    return True


# ---- nested compile regions: one schema per region and call signature ----------------------


def _operand_signature(operands: tuple) -> tuple:
    """What a region's schema can depend on in its operands: each one's type and tensor
    metadata, and which operands are the same object (aliasing changes mutation analysis)."""
    first_index: dict[int, int] = {}
    signature = []
    for i, operand in enumerate(operands):
        alias_of = first_index.setdefault(id(operand), i)
        if isinstance(operand, torch.Tensor):
            meta = (operand.dtype, tuple(operand.shape), operand.stride(), operand.requires_grad, operand.device.type)
        else:
            meta = repr(operand) if isinstance(operand, (int, float, bool, str)) else None
        signature.append((type(operand), meta, alias_of))
    return tuple(signature)


def memoize_nested_region_schemas() -> bool:
    """Generate a nested compile region's schema once per compile and call signature, not once
    per call. Returns whether it was installed.

    Why: on torch 2.11-2.13 the autograd dispatch of every `invoke_subgraph` call (one per
    transformer block, in each AOTAutograd pass) regenerates the region's schema to check it
    mutates no input, and generating it re-traces the block. With 28 blocks that was 17.5 s
    of a 28-layer whole-model compile on CPU (torch 2.13; 56 schema generations) and most of
    the 15 s AOTAutograd spends in its joint trace on the H200 (torch 2.11). Torch 2.13 caches
    the schema on its functionalization path only (`InvokeSubgraphCache.functionalize_schema_cache`,
    keyed by subgraph object, identifier and operand types); this applies the same idea to
    every caller, keyed more strictly (operand dtypes, shapes, strides, requires_grad and
    aliasing too), and scoped to one compile (the current `TracingContext`), so nothing is
    reused across models or compiles. The subgraph is held by the cache, so its id stays valid.
    """
    try:
        from torch._guards import TracingContext
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:
        return False
    original = InvokeSubgraphHOP.gen_schema
    if getattr(original, "weft_memoized", False):
        return True
    per_compile: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def gen_schema(self, subgraph, identifier, *operands):
        context = TracingContext.try_get()
        if context is None or identifier is None:
            return original(self, subgraph, identifier, *operands)
        cache = per_compile.setdefault(context, {})
        key = (id(subgraph), identifier, _operand_signature(operands))
        if key not in cache:
            cache[key] = (subgraph, original(self, subgraph, identifier, *operands))
        return cache[key][1]

    gen_schema.weft_memoized = True
    InvokeSubgraphHOP.gen_schema = gen_schema
    return True


def version_counter(tensor: torch.Tensor) -> int:
    """How many in-place writes autograd has counted on `tensor` (and its views). Writes made
    outside torch's dispatcher, such as a Triton kernel storing through a pointer, do not count."""
    return tensor._version
