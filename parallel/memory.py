"""Per-rank memory of a training step, read off a parallelized model: state exactly, the rest estimated.

Model-agnostic. Parameters, gradients and optimizer state are summed from the model's own
(possibly meta-device) parameters: each DTensor's local shard and dtype, so the numbers follow
whatever placements the tensor-parallel plan and the data-parallel engine gave them. Activation
bytes come from the model family (`ModelSpec.activation_bytes`), which knows what one block
saves for backward under each activation-checkpointing kind. This module combines them with
the data-parallel buffers and the loss into the peak of each phase of a step.

Assumptions, stated once (docs/planning.md has the reasoning and the measured error):
- Gradients have the local shape and dtype of their parameter (FSDP2 reduces into the sharded
  fp32 parameter's dtype), except compact gradients (one GPU): held in the compute dtype
  until the step, which widens them to fp32 a group at a time.
- AdamW keeps exp_avg and exp_avg_sq like the parameter, plus one 0-d fp32 `step` per tensor.
- A parameter sharded over a data-parallel mesh dim is all-gathered before use, one unit at a
  time, in the compute dtype, with the next unit prefetched; its gradient is reduced from a
  full-size buffer in the reduce dtype (FSDP2's reduce-scatter input). The last unit stays
  gathered from its forward into its backward (fsdp_reshard_after_forward = default).
- A parameter not sharded over any data-parallel dim whose dtype differs from the compute
  dtype is cast at use. Autograd keeps the cast copy until that layer's backward, except inside
  an activation-checkpointed block (the cast is recomputed, eager or compiled) and for an
  embedding table (a gather's backward reads only the indices).
- Rank 0 is estimated: uneven shards round up on the first ranks, so it holds the most.
"""

from __future__ import annotations

import gc
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement
from torch.multiprocessing.reductions import StorageWeakRef
# A dispatch mode is the documented way to see every op's output; the base class and pytree's
# tree_leaves live in private modules (long-standing, used across torch; checked on 2.13).
# Only retained_bytes uses them.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from parallel.activation_checkpoint import is_checkpointed
from parallel.compact_gradients import step_groups
from parallel.fsdp import unit_modules
from parallel.loss import CHUNK_ELEMENTS
from parallel.tensor_parallel import VocabParallelEmbedding

TP_DIM = "tp"  # the mesh dim that is not data parallel (parallel/mesh.py)
GIB = 1024**3


def local_numel(param: torch.Tensor) -> int:
    return param.to_local().numel() if isinstance(param, DTensor) else param.numel()


def _splits(placement: Placement) -> bool:
    """Whether a placement splits the tensor over its mesh dim: Shard, and FSDP's _StridedShard
    (which on torch 2.13 is neither a Shard subclass nor `is_shard()`)."""
    return not (placement.is_replicate() or placement.is_partial())


def _dp_dims(param: torch.Tensor) -> list[int]:
    """The data-parallel mesh dims (every dim but tp) that split `param`."""
    if not isinstance(param, DTensor):
        return []
    names = param.device_mesh.mesh_dim_names or ()
    return [dim for dim, placement in enumerate(param.placements)
            if _splits(placement) and (dim >= len(names) or names[dim] != TP_DIM)]


def _dp_shards(param: torch.Tensor) -> int:
    """Into how many pieces the data-parallel mesh dims split `param` (1: not dp-sharded)."""
    return math.prod(param.device_mesh.size(dim) for dim in _dp_dims(param))


def _is_dp_sharded(param: torch.Tensor) -> bool:
    """Sharded over a data-parallel mesh dim (even one of size 1: it is still gathered before use)."""
    return bool(_dp_dims(param))


def _placement_name(placement: Placement) -> str:
    if placement.is_replicate():
        return "Replicate"
    if placement.is_partial():
        return "Partial"
    return f"{type(placement).__name__.lstrip('_')}({placement.dim})"


def _placements(param: torch.Tensor) -> str:
    """e.g. "(dp_shard, tp): StridedShard(0), Shard(0)"; "-" for a plain tensor."""
    if not isinstance(param, DTensor):
        return "-"
    names = param.device_mesh.mesh_dim_names or tuple(str(i) for i in range(param.device_mesh.ndim))
    return f"({', '.join(names)}): " + ", ".join(_placement_name(p) for p in param.placements)


@dataclass(frozen=True)
class ParamGroup:
    """Parameters that differ only in their block index, with one placement and local shape."""

    name: str  # e.g. "layers.*.attention.wq.weight"
    count: int
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    placements: str  # e.g. "(dp_shard, tp): StridedShard(0), Shard(0)"
    dtype: torch.dtype

    @property
    def local_numel(self) -> int:
        return self.count * math.prod(self.local_shape)

    @property
    def local_bytes(self) -> int:
        return self.local_numel * self.dtype.itemsize


def parameter_groups(model: nn.Module) -> list[ParamGroup]:
    """The model's parameters with numeric path components replaced by '*', grouped by
    (name, shapes, placements, dtype), in model order: 405B's 1,137 tensors in a dozen rows."""
    groups: dict[tuple, list] = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        key = (re.sub(r"\.\d+\.", ".*.", name), tuple(param.shape), tuple(local.shape), _placements(param), param.dtype)
        groups.setdefault(key, []).append(name)
    return [ParamGroup(name=k[0], count=len(v), global_shape=k[1], local_shape=k[2], placements=k[3], dtype=k[4])
            for k, v in groups.items()]


@dataclass(frozen=True)
class StateBytes:
    """Bytes this rank holds for the whole run (optimizer state from the first step on)."""

    params: int
    grads: int  # at the end of backward
    optimizer: int  # AdamW: exp_avg + exp_avg_sq like each parameter, and a 4-byte step per tensor
    widened_grads: int = 0  # compact gradients: the largest group the step widens to fp32 at once
    step_group: int = 0  # parameter bytes one optimizer.step() call updates (all, or a compact group)
    weight_copies: int = 0  # compute-dtype copies of the compact parameters, kept for forward to read


def state_bytes(
    model: nn.Module, compact: Sequence[nn.Parameter] = (), compute_dtype: torch.dtype | None = None, widens: bool = True,
    weight_copies: bool = False,
) -> StateBytes:
    """State of `model`'s parameters; gradients of the `compact` ones are held in `compute_dtype`
    until the step, which widens them to fp32 one group at a time (parallel/compact_gradients.py),
    unless the optimizer reads them as they are (`widens=False`: the Triton AdamW). With
    `weight_copies` each compact parameter also has a copy in `compute_dtype` for the whole run."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    nbytes = lambda tensors: sum(local_numel(p) * p.dtype.itemsize for p in tensors)  # noqa: E731
    compact_ids = {id(p) for p in compact}
    narrow = sum(local_numel(p) * (p.dtype.itemsize - compute_dtype.itemsize) for p in compact if p.requires_grad)
    widened = max((nbytes(group) for group in step_groups([p for p in trainable if id(p) in compact_ids])), default=0)
    widened = widened if widens else 0
    # With compact gradients the step runs once for the parameters with an ordinary `.grad`,
    # then once per widened group.
    step_group = max(widened, nbytes(p for p in trainable if id(p) not in compact_ids))
    return StateBytes(params=nbytes(params), grads=nbytes(trainable) - narrow,
                      optimizer=2 * nbytes(trainable) + 4 * len(trainable), widened_grads=widened,
                      step_group=step_group,
                      weight_copies=sum(local_numel(p) for p in compact if p.requires_grad) * compute_dtype.itemsize
                      if weight_copies else 0)


@dataclass(frozen=True)
class UnitBytes:
    """One data-parallel unit (e.g. an FSDP group): what it holds while gathered and reduced."""

    name: str
    gathered: int  # its parameters after the data-parallel all-gather, in the compute dtype
    reduce_buffer: int  # its full gradient in the reduce dtype: the reduce-scatter input
    compute_copies: int  # cast-at-use copies kept for backward, of parameters not gathered (not dp-sharded)


def unit_bytes(
    units: Sequence[nn.Module | Sequence[nn.Module]],
    model: nn.Module,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> list[UnitBytes]:
    """Per unit, in forward order; parameters in no unit form a last "root" unit."""
    seen: set[int] = set()
    copies_kept = _cast_copies_kept(model)
    out = []
    for index, unit in enumerate([*units, model]):
        modules = unit_modules(unit)
        params = [p for m in modules for p in m.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        if not params and unit is model:
            continue
        gathered = [p for p in params if _is_dp_sharded(p)]
        full = sum(local_numel(p) * _dp_shards(p) for p in gathered)
        out.append(UnitBytes(
            name="root" if unit is model else _unit_name(model, modules, index),
            gathered=full * compute_dtype.itemsize,
            reduce_buffer=full * reduce_dtype.itemsize,
            compute_copies=_kept_copy_bytes(params, copies_kept, compute_dtype),
        ))
    return out


def _kept_copy_bytes(params: Sequence[nn.Parameter], kept: set[int], compute_dtype: torch.dtype) -> int:
    """Bytes of the cast-at-use copies of `params` that autograd keeps (ids in `kept`): only
    parameters not dp-sharded (a gathered one is counted as gathered) and not already in the
    compute dtype have one."""
    return sum(local_numel(p) for p in params
               if id(p) in kept and not _is_dp_sharded(p) and p.dtype != compute_dtype) * compute_dtype.itemsize


def cast_copy_bytes(module: nn.Module, compute_dtype: torch.dtype) -> int:
    """Bytes of the cast-at-use copies autograd would keep for `module`'s parameters if it
    were not activation-checkpointed: what a block of kind "none" adds to `unit_bytes`'s
    `compute_copies`, for the dry run to weigh layouts other than the one it built."""
    return _kept_copy_bytes(list(module.parameters()), _cast_copies_kept(module, through_checkpoints=True),
                            compute_dtype)


def _cast_copies_kept(model: nn.Module, through_checkpoints: bool = False) -> set[int]:
    """ids of the parameters whose cast-at-use copy autograd keeps from forward to backward.

    Not inside an activation-checkpointed module: the cast runs in the checkpointed forward, so
    it is recomputed in backward (eager) or the partitioner recomputes it from the stored
    parameter (compiled). Not an embedding table: its backward scatters by index and never
    reads the weight. Measured on CPU, torch 2.13: a compiled block without checkpointing saves
    the bf16 copies of its linear weights, a checkpointed one none (tests/test_memory_estimate.py).
    """
    kept: set[int] = set()

    def visit(module: nn.Module) -> None:
        if is_checkpointed(module) and not through_checkpoints:
            return
        if not isinstance(module, (nn.Embedding, VocabParallelEmbedding)):
            kept.update(id(p) for p in module._parameters.values() if p is not None)
        for child in module.children():
            visit(child)

    visit(model)
    return kept


def _unit_name(model: nn.Module, modules: list[nn.Module], index: int) -> str:
    names = {id(m): n for n, m in model.named_modules()}
    return "+".join(names.get(id(m), f"unit{index}") for m in modules)


@dataclass(frozen=True)
class ActivationInputs:
    """What a model family needs to count its activations on one rank."""

    tokens: int  # tokens of one micro-batch, local_batch_size x seq_len (every tp rank sees all of them)
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    compute_bytes: int  # bytes of one activation element (2 for bf16)
    compiled: bool  # blocks run under torch.compile
    fused_norm: bool  # the device has a fused RMSNorm kernel (CUDA); CPU's decomposes and saves more


@dataclass(frozen=True)
class ActivationBytes:
    """A model family's answer for one micro-batch on one rank."""

    blocks: int  # saved for backward by all blocks
    outside_blocks: int  # saved for backward outside the blocks (embedding, final norm, head input)
    block_backward: int  # working set of the largest block's backward: recomputed tensors + gradients
    logits_columns: int  # columns of the logits on this rank (vocab / tp with loss parallel)
    head_in_features: int  # the head's input width (its weight is [logits_columns, head_in_features])


def loss_bytes(tokens: int, columns: int, real_columns: int, *, compute_bytes: int, loss_parallel: bool,
               compiled: bool, fused_head: bool = False, head_in_features: int = 0,
               in_model_graph: bool = False, overwrites: bool = True) -> tuple[int, int, int]:
    """(forward peak, saved for backward, backward peak) of the logits and parallel/loss.py's
    cross-entropy, besides the head's input.

    Fused into the head (`training.head_loss = "fused"`, parallel/loss.py's
    `linear_cross_entropy`): forward holds the input's gradient (compute dtype), the weight's
    (summed in fp32) and one chunk of logits and of their gradient, with an fp32 chunk when
    eager; it saves the two gradients, which backward scales in place, rounding the weight's
    to the compute dtype beside its fp32 sum. No [tokens, vocab] tensor at all.

    Separate (`cross_entropy_loss`): the logits (compute dtype) are saved with one fp32
    log-sum-exp per token, and backward writes their gradient over them (`overwrites`: the
    trainer's loss on a head's own output; else, e.g. on the local view of replicated logits
    under tensor parallel without loss parallel, into a new tensor). Forward also holds
    the label logits, and, eagerly, one fp32 chunk of at most CHUNK_ELEMENTS (backward too);
    compiled passes hold nothing more. Traced in one graph with the model (whole-model
    compile), inductor saves the logits and backward adds their gradient as a new tensor.
    `real_columns` and `loss_parallel` do not change these sizes (the padded columns and the
    vocab shards are masked in place). Per-token integer temporaries are left out.
    """
    logits = tokens * columns * compute_bytes
    if fused_head:
        rows = min(tokens, max(1, CHUNK_ELEMENTS // columns))
        chunk = 2 * rows * columns * compute_bytes + (0 if compiled else 4 * rows * columns)
        weight_grad = columns * head_in_features
        saved = tokens * head_in_features * compute_bytes + weight_grad * 4
        return saved + chunk, saved, saved + weight_grad * compute_bytes
    if in_model_graph:
        return logits, logits, 2 * logits
    chunk = 0 if compiled else 4 * min(tokens * columns, CHUNK_ELEMENTS)
    saved = logits + 4 * tokens
    return saved + 4 * tokens + chunk, saved, saved + chunk + (0 if overwrites else logits)


def head_gradient_bytes(tokens: int, columns: int, in_features: int, *, compute_bytes: int, weight: bool) -> int:
    """What the head's backward creates while the logits' gradient is still alive: its input's
    gradient and (`weight`) its weight's, both in the compute dtype. A cast-at-use weight's
    gradient is widened to fp32 only after that, when the logits' gradient has been freed."""
    return (tokens * in_features + (columns * in_features if weight else 0)) * compute_bytes


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryEstimate:
    state: StateBytes
    activations: ActivationBytes
    activation_total: int  # blocks + outside_blocks + cast copies - offloaded, one micro-batch, on the GPU
    loss: tuple[int, int, int]
    largest_gathered: int
    accumulated_grads: int  # gradients held between micro-batches (0 without accumulation)
    phases: list[Phase]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)


def estimate_memory(
    state: StateBytes,
    units: list[UnitBytes],
    act: ActivationBytes,
    act_inputs: ActivationInputs,
    *,
    real_columns: int,
    compiled_loss: bool,
    loss_in_model_graph: bool = False,
    grad_accum_steps: int,
    defer_reduce_scatter: bool,
    reshard_after_forward: str,
    foreach_optimizer: bool,
    fused_head: bool = False,
    cast_copies: int | None = None,
    offloaded: int = 0,
    offload_unreleased: int = 0,
) -> MemoryEstimate:
    """The peak of each phase of a training step on one rank, from state, units and activations.

    Phases: the loss (end of forward), the loss's backward, the head's backward, the last
    block's backward (the first one backward runs, with every activation still held), the end
    of backward, and the optimizer step. Within backward, freed activations and new gradients
    change linearly from block to block, so the two ends stand for all of them. With gradient accumulation the last
    micro-batch is the largest: it runs with the earlier ones' gradients held.
    `cast_copies` replaces the units' `compute_copies` in all (another checkpointing layout).
    `offloaded`: activation bytes held in host memory from forward to backward
    (parallel/activation_offload.py); they come back only near the end of backward, when the
    blocks after them have freed more, so they leave every phase that holds activations.
    Their device memory is released some blocks into forward: `offload_unreleased`, the most
    block activations forward holds beyond those of its end, adds a phase where that is more
    (the blocks' own working set left out, as in the other forward phase).
    """
    a, tokens = act_inputs.compute_bytes, act_inputs.tokens
    loss_fwd, loss_saved, loss_bwd = loss_bytes(
        tokens, act.logits_columns, real_columns, compute_bytes=a, loss_parallel=act_inputs.loss_parallel,
        compiled=compiled_loss, fused_head=fused_head, head_in_features=act.head_in_features,
        in_model_graph=loss_in_model_graph,
        # parallel/loss.py overwrites only an op's own output: under tp without loss parallel the
        # loss gets the local view of the replicated logits.
        overwrites=act_inputs.tp == 1 or act_inputs.loss_parallel,
    )
    gathered_units = [u for u in units if u.gathered]
    largest = max((u.gathered for u in gathered_units), default=0)
    head, embedding = units[-1] if units[-1].name != "root" else units[-2], units[0]
    block = max(units[1:-1] or units, key=lambda u: u.gathered)
    kept = {"default": head.gathered, "always": 0, "never": sum(u.gathered for u in units)}[reshard_after_forward]
    if grad_accum_steps == 1:
        held = 0
    elif gathered_units and defer_reduce_scatter:
        held = sum(u.reduce_buffer for u in units)  # unsharded accumulators in the reduce dtype
    else:
        held = state.grads
    casts = sum(u.compute_copies for u in units) if cast_copies is None else cast_copies
    activations = act.blocks + act.outside_blocks + casts - offloaded
    base = {"parameters": state.params, "weight copies": state.weight_copies, "optimizer state": state.optimizer}
    running = {**base, "gradients held for accumulation": held, "activations": activations}  # last micro-batch
    grad_logits = 0 if fused_head else tokens * act.logits_columns * a
    # A fused head keeps its two gradients (counted in the loss's saved bytes) instead of its
    # input and its cast weight, which are alive in its forward only.
    # The head is vocab-sharded under tp; without loss parallel its logits are all vocab columns.
    head_rows = act.logits_columns if act_inputs.loss_parallel else act.logits_columns // act_inputs.tp
    head_weight_copy = min(head.compute_copies, head_rows * act.head_in_features * a)
    freed = tokens * act.head_in_features * a + head_weight_copy if fused_head else 0
    after_forward = {**running, "activations": activations - freed}
    # Under data parallel the head weight's gradient is the unit gradient below; a fused head
    # made both gradients in forward.
    head_grads = 0 if fused_head else head_gradient_bytes(
        tokens, head_rows, act.head_in_features, compute_bytes=a, weight=not head.gathered)
    # Within the blocks: what comes after them (the final norm, the head's input and its cast
    # copy) does not exist yet; a block is gathered, the next one prefetched.
    unreleased_phase = [Phase("forward: offloaded blocks not yet released", {
        **running, "activations": activations + offload_unreleased - act.outside_blocks - head.compute_copies,
        "gathered parameters": 2 * block.gathered,
    })] if offload_unreleased else []
    phases = [
        *unreleased_phase,
        Phase("forward: the loss", {**running, "logits + loss": loss_fwd, "gathered parameters": kept}),
        Phase("backward: the loss", {**after_forward, "logits + loss": loss_bwd, "gathered parameters": kept}),
        Phase("backward: the head", {**after_forward, "logits gradient": grad_logits,
                                     "head input + weight gradients": head_grads,
                                     "gathered parameters": kept + block.gathered,
                                     "unit gradients + reduce buffer": head.gathered + head.reduce_buffer}),
        Phase("backward: the last block", {**after_forward, "block backward working set": act.block_backward,
                                           "gathered parameters": 2 * block.gathered,  # it and the prefetched next
                                           "unit gradients + reduce buffer": block.gathered + block.reduce_buffer}),
        Phase("backward: the end", {**base, "gradients": state.grads,
                                    "unit gradients + reduce buffer": embedding.gathered + embedding.reduce_buffer}),
        Phase("optimizer step", {**base, "gradients": state.grads, "gradients widened to fp32": state.widened_grads,
                                 "optimizer temporaries": state.step_group if foreach_optimizer else 0}),
    ]
    return MemoryEstimate(state=state, activations=act, activation_total=activations,
                          loss=(loss_fwd, loss_saved, loss_bwd), largest_gathered=largest,
                          accumulated_grads=held, phases=phases)


def _unwrap(t: object) -> object:
    """The plain tensor inside a DTensor or a functional collective's AsyncCollectiveTensor (both
    storage-less wrappers; their `_local_tensor` / `elem` attributes, checked on torch 2.13)."""
    while isinstance(t, torch.Tensor) and type(t) is not torch.Tensor:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if inner is None:
            return t
        t = inner
    return t


def peak_new_bytes(fn: Callable[[], object]) -> int:
    """The most bytes that storages created by eager `fn()` (not views of, or writes into, its
    operands) hold at once while it runs: the working set of an op sequence, e.g. the loss's
    chunks (tests/test_memory_estimate.py). Like `retained_bytes`, blind to compiled code."""
    live: dict[int, tuple[StorageWeakRef, int]] = {}
    peak = 0

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal live, peak
            out = func(*args, **(kwargs or {}))
            operands = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in operands:
                    storage = t.untyped_storage()
                    known = live.get(storage.data_ptr())
                    if known is None or known[0].expired():
                        live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            live = {ptr: entry for ptr, entry in live.items() if not entry[0].expired()}
            peak = max(peak, sum(n for _, n in live.values()))
            return out

    with _Track():
        fn()
    return peak


def retained_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages that eager `fn()` creates and leaves alive, output and `exclude`
    (parameters, inputs) aside: what autograd, and activation checkpointing, keep for backward.

    The check behind the model families' activation formulas (tests/test_memory_estimate.py,
    scripts/measure_activations.py). Storages are tracked by weak reference, so a tensor kept
    by autograd without a Python object is still seen; compiled code allocates outside the
    dispatcher, so it needs `saved_tensor_bytes` instead.
    """
    created: dict[int, tuple[StorageWeakRef, int]] = {}

    class _Track(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                t = _unwrap(t)
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    known = created.get(storage.data_ptr())
                    if known is None or known[0].expired():
                        created[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
            return out

    with _Track():
        out = fn()
    gc.collect()  # a reference cycle from the forward would otherwise count until the collector ran
    leaves = [_unwrap(t) for t in (*exclude, *tree_leaves(out))]
    skip = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
    return sum(n for ptr, (ref, n) in created.items() if ptr not in skip and not ref.expired())


def saved_tensor_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn()` runs, `exclude`
    aside: works for compiled regions too (AOTAutograd saves through the same hooks), but not
    inside activation checkpointing, whose own hooks take over (use `retained_bytes` there)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    return sum(n for ptr, n in saved.items() if ptr not in skip)
