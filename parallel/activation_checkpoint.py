"""Activation checkpointing of transformer blocks: full, every N-th block, op-level selective,
or a kind per block.

Model-agnostic: the caller passes the container of blocks (e.g. `model.layers`). A block is
checkpointed in place by swapping its class for a subclass whose `forward` runs the original
forward under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. FSDP2's
`fully_shard` uses the same class-swap trick, and it keeps what matters to the rest of the
framework unchanged: parameter and state-dict names (no `_checkpoint_wrapped_module.` prefix),
`isinstance` checks, and module hooks, which stay outside the checkpointed region so FSDP2's
all-gather hooks are not replayed by the recompute.

Order of application (see docs/compile_and_ac.md): tensor parallel, then AC, then compile,
then FSDP. AC must come before compile so the compiler sees the checkpoint region and its
save/recompute policy; FSDP comes last so its hooks wrap the finished (checkpointed,
compiled) block.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
# Private module, imported only so that the _c10d_functional_autograd ops exist when the save
# list below is built (they register on import); checked on torch 2.11 and 2.13.
import torch.distributed._functional_collectives  # noqa: F401
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from parallel.torch_internals import source_hash

AC_MODES = ("none", "full", "selective", "memory_budget", "per_block")

# What one block can be, from the least activation memory (and the most recompute) to the most:
# "full" (recompute all but attention and collectives), "op" (op SAC, every other matmul output
# saved), "op_all" (op SAC, every matmul output saved) and "none" (no checkpointing).
BLOCK_KINDS = ("full", "op", "op_all", "none")

aten = torch.ops.aten

# Matmuls dominate recompute time and their outputs dominate block memory: saving every other
# one splits the difference between keeping them all and recomputing them all.
_MATMUL_OPS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})


def _existing_ops(namespace: object, names: list[str]) -> set:
    """`<namespace>.<name>.default` for the names this torch build has (checked on 2.11-2.13)."""
    return {getattr(namespace, n).default for n in names if hasattr(namespace, n)}


def _ops_to_save() -> frozenset:
    """Ops whose outputs are always saved: recomputing them costs far more than storing them.

    Attention kernels (quadratic in sequence length), and collectives (recomputing one would
    issue the communication again inside backward; under sequence parallel that includes the
    all-gather in front of attention and the MLP). The CPU math fallback of
    `F.scaled_dot_product_attention` (used for e.g. float64 or an explicit math backend) is a
    composite op: it dispatches as bmm / softmax / ..., so it falls under the matmul rule.
    """
    attention = _existing_ops(
        aten,
        [
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_fused_attention_overrideable",
        ],
    )
    # _c10d_functional: what functional collectives and DTensor redistribute dispatch to;
    # _c10d_functional_autograd: their differentiable variants used by funcol's autograd path.
    collectives = ["reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"]
    collectives = _existing_ops(torch.ops._c10d_functional, collectives) | _existing_ops(
        torch.ops._c10d_functional_autograd, collectives
    )
    return frozenset(attention | collectives)


_SAVE_OPS = _ops_to_save()

# Process groups whose collectives are recomputed in backward rather than saved: the graph
# data-parallel engine's parameter all-gathers (parallel/graph_data_parallel.py). Saving
# them would keep every gathered weight alive from forward to backward.
_RECOMPUTED_GROUPS: set[str] = set()


def recompute_collectives_on(group_name: str) -> None:
    """Checkpointed regions recompute collectives on this process group instead of saving them."""
    _RECOMPUTED_GROUPS.add(group_name)


def _saved(func, args) -> bool:
    """Whether an op the policies save always (attention, collectives) is saved for this call.
    A functional collective names its process group with a string argument."""
    if func not in _SAVE_OPS:
        return False
    return not (_RECOMPUTED_GROUPS and any(isinstance(a, str) and a in _RECOMPUTED_GROUPS for a in args))


OP_SAC_MATMULS = ("alternate", "all")


def op_level_policy(counts: dict[str, int], matmuls: str = "alternate") -> Callable[..., CheckpointPolicy]:
    """The selective-AC policy of one checkpointed call; `counts` is that call's matmul counter.

    `matmuls` "alternate" saves the 1st, 3rd, ... matmul output of the call and recomputes the
    others (torchtitan's op SAC); "all" saves every one, so backward recomputes only norms and
    pointwise ops: for runs with memory to spare (eager above all, where the compiler's
    `memory_budget` is not available). Forward and recompute count matmuls separately (keyed
    by `ctx.is_recompute`) so that the recompute makes the same save/recompute decision for
    the k-th matmul as the forward did.
    """
    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in _MATMUL_OPS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            saved = matmuls == "all" or counts[key] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE
        if _saved(func, args):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def op_level_context_fn():
    """`context_fn` for op SAC saving every other matmul: a fresh matmul counter for every call."""
    return create_selective_checkpoint_contexts(op_level_policy(defaultdict(int), "alternate"))


def op_level_all_matmuls_context_fn():
    """`context_fn` for op SAC saving every matmul."""
    return create_selective_checkpoint_contexts(op_level_policy(defaultdict(int), "all"))


def _recompute_all_but_attention(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _saved(func, args) else CheckpointPolicy.PREFER_RECOMPUTE


def full_context_fn():
    """`context_fn` for full AC: recompute everything but the attention kernel and collectives.

    Their outputs are one activation each per block, and keeping them means backward never
    re-runs the most expensive kernel or repeats communication. It is also what makes full AC
    compile with tensor parallel: plain `checkpoint` (and any policy that recomputes SDPA)
    under torch.compile with DTensor activations fails in AOTAutograd with "expected all
    tensors_saved_with_vc_check to be Tensors ... DeviceMesh" (torch 2.13, TP + sequence
    parallel), while saving the attention output traces cleanly.
    """
    return create_selective_checkpoint_contexts(_recompute_all_but_attention)


# AOTAutograd caches a graph with a checkpoint region only if its `context_fn` carries a
# `cache_hash` naming the save/recompute behaviour (read by torch 2.13's autograd_cache.py; a
# torch that does not read it bypasses the cache for these graphs). The policies are this
# file's code and the torch version's op set (the torch version is in the key already). The
# functions are module-level so that inductor's cache key can pickle them.
_POLICY_HASH = source_hash(__file__)
op_level_context_fn.cache_hash = f"weft-op-sac-{_POLICY_HASH}"
op_level_all_matmuls_context_fn.cache_hash = f"weft-op-sac-all-matmuls-{_POLICY_HASH}"
full_context_fn.cache_hash = f"weft-full-ac-{_POLICY_HASH}"

# A block's checkpointing kind -> its `context_fn`: "full", "op" (op SAC, every other matmul
# saved) and "op_all" (op SAC, every matmul saved).
_CONTEXT_FNS = {"full": full_context_fn, "op": op_level_context_fn, "op_all": op_level_all_matmuls_context_fn}
_CHECKPOINTED_CLASSES: dict[tuple[type, str], type] = {}


def _checkpointed_class(cls: type, kind: str) -> type:
    """A subclass of `cls` whose forward runs `cls.forward` under non-reentrant checkpoint."""
    key = (cls, kind)
    if key not in _CHECKPOINTED_CLASSES:
        context_fn = _CONTEXT_FNS[kind]

        def forward(self, *args, **kwargs):
            return checkpoint(cls.forward, self, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        prefix = "Checkpointed" if kind == "full" else "SelectiveCheckpointed"
        _CHECKPOINTED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
    return _CHECKPOINTED_CLASSES[key]


def is_checkpointed(module: nn.Module) -> bool:
    """Whether `apply_activation_checkpointing` wrapped this module (also once FSDP2 wrapped it)."""
    return isinstance(module, tuple(_CHECKPOINTED_CLASSES.values()))


def checkpoint_kind(module: nn.Module) -> str:
    """How a block is checkpointed: "none", "full" (recompute all but attention and collectives),
    "op" (op SAC saving every other matmul) or "op_all" (op SAC saving every matmul); read off
    the module, so it is what was applied."""
    for (_, kind), cls in _CHECKPOINTED_CLASSES.items():
        if isinstance(module, cls):
            return kind
    return "none"


def parse_per_block(layout: str, n_blocks: int | None = None) -> list[str]:
    """`activation_checkpoint.per_block`, e.g. "op_all:12,op:16", as one kind per block from the
    first block on. With `n_blocks` the counts must add up to it. ValueError names the fix."""
    kinds: list[str] = []
    for part in layout.split(","):
        kind, _, count = part.strip().partition(":")
        if kind not in BLOCK_KINDS or not (count.isascii() and count.isdigit()):
            raise ValueError(f"activation_checkpoint.per_block must be kind:count,... with kinds "
                             f"{', '.join(BLOCK_KINDS)} (e.g. 'op_all:12,op:16'); got {layout!r}.")
        kinds += [kind] * int(count)
    if n_blocks is not None and len(kinds) != n_blocks:
        raise ValueError(f"activation_checkpoint.per_block = {layout!r} lays out {len(kinds)} blocks; "
                         f"the model has {n_blocks}.")
    return kinds


def block_kinds(
    n_blocks: int, mode: str, selective_ac_option: str, op_sac_matmuls: str = "alternate", per_block: str = ""
) -> list[str]:
    """Each block's kind (`BLOCK_KINDS`), following `[activation_checkpoint]` in the config.

    mode "none" and "memory_budget" (the compiler decides, `set_activation_memory_budget`):
    no block is wrapped. "full": every block. "selective" with option "op": every block under
    op SAC, saving every other matmul output or all of them as `op_sac_matmuls` says;
    with option N: the N-th, 2N-th, ... block (1-based) as in "full". "per_block": the
    `per_block` layout, e.g. "op_all:12,op:16", to spend exactly the memory a run has.
    """
    if op_sac_matmuls not in OP_SAC_MATMULS:
        raise ValueError(f"activation_checkpoint.op_sac_matmuls must be one of {', '.join(OP_SAC_MATMULS)}; "
                         f"got {op_sac_matmuls!r}.")
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint.mode must be one of {', '.join(AC_MODES)}; got {mode!r}.")
    if mode in ("none", "memory_budget"):
        return ["none"] * n_blocks
    if mode == "per_block":
        return parse_per_block(per_block, n_blocks)
    if mode == "full" or selective_ac_option == "op":
        kind = "full" if mode == "full" else ("op_all" if op_sac_matmuls == "all" else "op")
        return [kind] * n_blocks
    if not (selective_ac_option.isdigit() and int(selective_ac_option) >= 1):
        raise ValueError(
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {selective_ac_option!r}."
        )
    every = int(selective_ac_option)
    return ["full" if (i + 1) % every == 0 else "none" for i in range(n_blocks)]


def apply_activation_checkpointing(
    blocks: nn.ModuleDict | nn.ModuleList,
    mode: str,
    selective_ac_option: str,
    op_sac_matmuls: str = "alternate",
    per_block: str = "",
) -> None:
    """Checkpoint the blocks in place, each as `block_kinds` says for these settings."""
    modules = blocks.values() if isinstance(blocks, nn.ModuleDict) else list(blocks)
    kinds = block_kinds(len(modules), mode, selective_ac_option, op_sac_matmuls, per_block)
    for i, (block, kind) in enumerate(zip(modules, kinds)):
        if is_checkpointed(block):
            raise ValueError(f"block {i} ({type(block).__name__}) is already activation-checkpointed.")
        if kind != "none":
            block.__class__ = _checkpointed_class(type(block), kind)


def set_activation_memory_budget(budget: float) -> None:
    """Let the compiler choose what each compiled region saves for backward, within `budget`.

    `torch._functorch.config.activation_memory_budget` (private; present and read by the
    min-cut partitioner on torch 2.4-2.13, checked on 2.13) is a fraction of the activation
    memory that the compiled region would keep with no AC (1.0, torch's default); 0.0 is
    the memory of recomputing everything. Below 1.0 the partitioner solves a knapsack that
    recomputes the cheapest ops first by FLOP count, so pointwise and norm outputs go before
    any matmul: at a budget that matches op-level SAC's memory it recomputes less than op
    SAC, which recomputes every other matmul. Collectives are never recomputed, so it
    composes with tensor parallelism (DTensor code is traced to plain ops and collectives).
    It replaces the checkpoint wrappers (mode "memory_budget" adds none); it is read when a
    region is first compiled, so it must be set before the first forward, and it applies to
    every region this process compiles. Without compile it has no effect.
    """
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = budget
    # The knapsack sizes every value it may save. Under tensor parallelism the compiled graphs
    # take process groups as script-object inputs, which torch 2.13 refuses to size unless
    # told they are empty ("Cannot compute the size of FakeScriptObject"); a process group
    # holds no tensors, so zero is exact. Checked on 2.13; the check is for versions without
    # the flag. Compiled blocks without TP (one GPU, FSDP) hold no process groups at all.
    if hasattr(functorch_config, "unsafe_treat_script_objects_as_zero_size"):
        functorch_config.unsafe_treat_script_objects_as_zero_size = budget < 1.0
