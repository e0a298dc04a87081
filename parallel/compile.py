"""torch.compile of the model (per transformer block, or whole) and of the loss.

Compilation is in place (`Module.compile`) or of a function that calls the model, never
`torch.compile(module)`: the wrapper that the latter returns renames every state-dict key
with an `_orig_mod.` prefix, which would leak into checkpoints. Shapes are static (`dynamic=False`): the data loader never yields a
partial batch, so a shape change is a bug worth a visible recompile rather than a silently
symbolic graph.

Order of application: tensor parallel, activation checkpointing, then `apply_compile` with
"blocks", then data parallel, then `apply_compile` with "model" (trainer/build.py), and the
training forward with its loss (`compile_forward_loss`, trainer/trainer.py; the
cross-entropy's own passes, `cross_entropy_kernels`, when the loss is compiled apart). See
docs/compile_and_ac.md for why, and for what the "model" strategy gives with each
data-parallel engine.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from parallel.loss import EAGER_KERNELS, CrossEntropyKernels, compiled_kernels
from parallel.torch_internals import memoize_nested_region_schemas


class Compile(Protocol):
    """The `[compile]` settings this module reads (trainer.config.Compile has them)."""

    enable: bool
    strategy: str
    backend: str
    components: list
    recompile_limit: int

STRATEGIES = ("blocks", "model")

# Whatever the user set (TORCH_COMPILE_CACHE_KEY_TAG) stays part of the key.
_USER_CACHE_KEY_TAG = torch.compiler.config.cache_key_tag


def key_compile_caches_by_process_groups(mesh: DeviceMesh, extra: str = "") -> None:
    """Make this rank's process groups part of torch.compile's on-disk cache keys.

    Why: a compiled graph calls its collectives by process-group *name*, a string baked into
    the FX graph cache and AOTAutograd cache entries, but the key those caches compute does
    not contain it (torch 2.13: a DeviceMesh reaches the graph as an opaque input, hashed by
    its position only, and a DTensor hashes its mesh by shape and dim names, which every tp
    group of a 2x2 mesh shares). On a warm cache, ranks 0/1 then load the graph that ranks
    2/3 wrote, and fail with "Could not resolve the process group registered under the name
    4" (pytorch#189330 discusses group names in traced graphs). Inductor's all-gather
    bucketing also bakes the rank into the graph after the key is computed (pytorch#191878).

    The tag names the rank and the group of every mesh dim, so an entry is reused only by a
    process that resolves the same names to the same groups: the same rank of a later run
    that builds its groups in the same order. `torch.compiler.config.cache_key_tag` is the
    public knob for this (torch >= 2.6; checked on 2.11 and 2.13). `extra` names anything else
    that changes compiled code without being in the key (e.g. a joint-graph pass).
    """
    groups = ",".join(f"{name}={mesh.get_group(name).group_name}" for name in mesh.mesh_dim_names)
    tag = f"weft:rank={dist.get_rank()}/{dist.get_world_size()}:groups={groups}" + (f":{extra}" if extra else "")
    torch.compiler.config.cache_key_tag = f"{_USER_CACHE_KEY_TAG}|{tag}" if _USER_CACHE_KEY_TAG else tag


def _set_recompile_limit(limit: int) -> None:
    # `recompile_limit` is the torch >= 2.7 name; `cache_size_limit` is an alias of it on the
    # supported versions (checked on 2.13), so setting one sets both.
    torch._dynamo.config.recompile_limit = limit


def fuses_loss(compile_cfg: Compile) -> bool:
    """Whether the model and the loss are compiled together, as one graph."""
    return (
        compile_cfg.enable
        and compile_cfg.strategy == "model"
        and "model" in compile_cfg.components
        and "loss" in compile_cfg.components
    )


_REUSED_CLASSES: dict[type, type] = {}


def _reused_class(cls: type) -> type:
    """A subclass of `cls` whose forward is a `torch.compiler.nested_compile_region` (torch >= 2.8):
    traced and compiled once, then called for every block of the same shape."""
    if cls not in _REUSED_CLASSES:
        forward = torch.compiler.nested_compile_region(cls.forward)
        _REUSED_CLASSES[cls] = type(f"Reused{cls.__name__}", (cls,), {"forward": forward})
    return _REUSED_CLASSES[cls]


def apply_compile(
    model: nn.Module,
    blocks: nn.ModuleDict | nn.ModuleList,
    compile_cfg: Compile,
    *,
    fullgraph: bool = False,
    reuse_blocks: bool = False,
) -> nn.Module:
    """Compile in place following `[compile]`; a no-op unless enabled with "model" in components.

    strategy "blocks": each block's forward is one full graph (`fullgraph=True`), so a graph
    break inside a block is an error instead of a silent slowdown; identical blocks share
    the compiled code. strategy "model": the whole model is one compile region, with graph
    breaks an error when `fullgraph` (nothing in it is untraceable) and allowed otherwise,
    which FSDP2 needs: its hooks are excluded from tracing. When "loss" is in components too,
    the model is compiled together with the loss by `compile_forward_loss`, not here.
    `reuse_blocks` (strategy "model"): each block is a nested compile region, so a deep model
    compiles its block once instead of once per layer. On torch 2.13 it fails as soon as the
    blocks hold DTensors (tensor parallel, or the graph data-parallel engine): pass it only
    for a model of plain tensors. It is ignored with backend "eager", which runs no
    AOTAutograd: a nested region's backward then fails ("fake_mode should be enabled for
    HOPs", torch 2.13), so there the blocks are traced inline.
    """
    if not compile_cfg.enable or "model" not in compile_cfg.components:
        return model
    if compile_cfg.strategy not in STRATEGIES:
        raise ValueError(f"compile.strategy must be one of {', '.join(STRATEGIES)}; got {compile_cfg.strategy!r}.")
    _set_recompile_limit(compile_cfg.recompile_limit)
    modules = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks
    if compile_cfg.strategy == "blocks":
        for block in modules:
            block.compile(backend=compile_cfg.backend, fullgraph=True, dynamic=False)
        return model
    if reuse_blocks and compile_cfg.backend != "eager":
        memoize_nested_region_schemas()
        for block in modules:
            block.__class__ = _reused_class(type(block))
    if not fuses_loss(compile_cfg):
        model.compile(backend=compile_cfg.backend, fullgraph=fullgraph, dynamic=False)
    return model


def compile_loss(loss_fn: Callable[..., torch.Tensor], compile_cfg: Compile) -> Callable[..., torch.Tensor]:
    """`loss_fn` compiled following `[compile]`; `loss_fn` itself unless "loss" is in components.

    For a function that computes a loss or part of one on plain tensors (the fused head's
    chunk). Graph breaks are allowed.
    """
    if not compile_cfg.enable or "loss" not in compile_cfg.components:
        return loss_fn
    _set_recompile_limit(compile_cfg.recompile_limit)
    return torch.compile(loss_fn, backend=compile_cfg.backend, dynamic=False)


def cross_entropy_kernels(compile_cfg: Compile) -> CrossEntropyKernels:
    """The passes of parallel/loss.py's cross-entropy: compiled when `[compile]` compiles the
    loss apart from the model, eager (chunked) otherwise.

    Compiling the passes rather than the loss keeps its autograd.Function eager, so backward
    can write the logits' gradient over the logits; a compiled loss graph allocates its
    gradient output anew. With the model and loss as one graph the loss is traced with the
    model and these kernels are not used.
    """
    if not compile_cfg.enable or "loss" not in compile_cfg.components or fuses_loss(compile_cfg):
        return EAGER_KERNELS
    _set_recompile_limit(compile_cfg.recompile_limit)
    return compiled_kernels(compile_cfg.backend)


def _plain(loss: torch.Tensor) -> torch.Tensor:
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def compile_forward_loss(
    model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, compile_cfg: Compile, *, fullgraph: bool = False
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """`(inputs, labels) -> loss_fn(model(inputs), labels)`, the training forward; with
    `loss_fn` None, `model(inputs, labels)` (a model whose head computes the loss).

    With strategy "model" and both "model" and "loss" in components, this one function is
    compiled, so the head, the softmax and the loss (loss parallel included) sit in the same
    graph as the model and inductor can fuse them. `fullgraph` as in `apply_compile`.
    Otherwise the model is whatever `apply_compile` made it and `loss_fn` runs as given: a
    loss compiled apart from the model compiles its own parts (`cross_entropy_kernels`).
    Compiling a function rather than the module keeps state-dict names unchanged.

    The loss comes back as a plain tensor (under loss parallel it is a replicated DTensor).
    A compiled graph that returns a DTensor also returns its DeviceMesh, and on torch 2.13
    tracing then failed in the partitioner ("Node tangents_2 was invalid, but is output")
    whenever that mesh was not the very object passed in.
    """
    if not fuses_loss(compile_cfg):
        if loss_fn is None:
            return lambda inputs, labels: model(inputs, labels)
        return lambda inputs, labels: _plain(loss_fn(model(inputs), labels))
    _set_recompile_limit(compile_cfg.recompile_limit)

    def forward_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(inputs, labels) if loss_fn is None else _plain(loss_fn(model(inputs), labels))

    return torch.compile(forward_loss, backend=compile_cfg.backend, fullgraph=fullgraph, dynamic=False)
