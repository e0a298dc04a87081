"""torch.compile of the model (per transformer block, or whole) and of the loss.

Compilation is in place (`Module.compile`), never `torch.compile(module)`: the wrapper that
the latter returns renames every state-dict key with an `_orig_mod.` prefix, which would
leak into checkpoints. Shapes are static (`dynamic=False`): the data loader never yields a
partial batch, so a shape change is a bug worth a visible recompile rather than a silently
symbolic graph.

Order of application: tensor parallel, activation checkpointing, then `apply_compile` with
"blocks", then FSDP, then `apply_compile` with "model" (trainer/build.py). See
docs/compile_and_ac.md for why, and for what the "model" strategy does under FSDP2.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


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


def key_compile_caches_by_process_groups(mesh: DeviceMesh) -> None:
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
    public knob for this (torch >= 2.6; checked on 2.11 and 2.13).
    """
    groups = ",".join(f"{name}={mesh.get_group(name).group_name}" for name in mesh.mesh_dim_names)
    tag = f"weft:rank={dist.get_rank()}/{dist.get_world_size()}:groups={groups}"
    torch.compiler.config.cache_key_tag = f"{_USER_CACHE_KEY_TAG}|{tag}" if _USER_CACHE_KEY_TAG else tag


def _set_recompile_limit(limit: int) -> None:
    # `recompile_limit` is the torch >= 2.7 name; `cache_size_limit` is an alias of it on the
    # supported versions (checked on 2.13), so setting one sets both.
    torch._dynamo.config.recompile_limit = limit


def apply_compile(model: nn.Module, blocks: nn.ModuleDict | nn.ModuleList, compile_cfg: Compile) -> nn.Module:
    """Compile in place following `[compile]`; a no-op unless enabled with "model" in components.

    strategy "blocks": each block's forward is one full graph (`fullgraph=True`), so a graph
    break inside a block is an error instead of a silent slowdown; identical blocks share
    the compiled code. strategy "model": the whole model is one compile region with graph
    breaks allowed, which FSDP2 needs: its hooks are excluded from tracing.
    """
    if not compile_cfg.enable or "model" not in compile_cfg.components:
        return model
    if compile_cfg.strategy not in STRATEGIES:
        raise ValueError(f"compile.strategy must be one of {', '.join(STRATEGIES)}; got {compile_cfg.strategy!r}.")
    _set_recompile_limit(compile_cfg.recompile_limit)
    if compile_cfg.strategy == "blocks":
        modules = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks
        for block in modules:
            block.compile(backend=compile_cfg.backend, fullgraph=True, dynamic=False)
    else:
        model.compile(backend=compile_cfg.backend, dynamic=False)
    return model


def compile_loss(loss_fn: Callable[..., torch.Tensor], compile_cfg: Compile) -> Callable[..., torch.Tensor]:
    """The loss compiled following `[compile]`; `loss_fn` itself unless "loss" is in components.

    Graph breaks are allowed: under loss parallel the loss runs on DTensors, whose dispatch
    may not trace as one graph.
    """
    if not compile_cfg.enable or "loss" not in compile_cfg.components:
        return loss_fn
    _set_recompile_limit(compile_cfg.recompile_limit)
    return torch.compile(loss_fn, backend=compile_cfg.backend, dynamic=False)
