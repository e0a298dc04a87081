"""Build the model and parallelize it: the one place that fixes the order of the steps.

Order (as torchtitan): meta-device construction -> tensor parallel -> activation checkpointing
-> per-block compile -> data parallel -> whole-model compile -> materialize on the device -> init.
TP comes first because AC, compile and data parallel all wrap the TP'd modules; AC wraps each
block before the block is compiled so the recompute is traced into the compiled region; FSDP
comes after per-block compile so its hooks stay outside each block's graph (the graph engine's
gathers, which run inside the blocks, are traced either way); whole-model compile goes last so
the graph covers the model as it will run. When the loss is compiled with the model, the
trainer compiles the two together (parallel.compile.compile_forward_loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models import ModelSpec
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.compile import apply_compile, key_compile_caches_by_process_groups
from parallel.data_parallel import apply_data_parallel, resolve_engine, traceable
from parallel.init import sharded_init_normal_
from parallel.mesh import ParallelDims
from parallel.parameter_views import stored_parameters
from parallel.torch_internals import joint_pass_cache_hash
from parallel.tensor_parallel import apply_tensor_parallel
from trainer.config import JobConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ParallelFlags:
    """The parallel features in effect after defaults and degrees are taken into account."""

    sequence_parallel: bool
    loss_parallel: bool
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    data_parallel_engine: str  # "fully_shard" | "graph" ("auto" resolved)
    whole_graph: bool  # nothing in the model is hidden from the compiler (no FSDP2 hooks)


def parallel_flags(cfg: JobConfig, dims: ParallelDims, device: torch.device) -> ParallelFlags:
    p = cfg.parallelism
    param = cfg.training.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device.type == "cuda" else "float32"
    c = cfg.compile
    engine = resolve_engine(p.data_parallel_engine,
                            whole_model_compile=c.enable and c.strategy == "model" and "model" in c.components)
    return ParallelFlags(
        sequence_parallel=dims.tp > 1 and p.enable_sequence_parallel,
        loss_parallel=dims.tp > 1 and p.enable_loss_parallel,
        param_dtype=DTYPES[param],
        reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce],
        data_parallel_engine=engine,
        whole_graph=traceable(engine, dims.dp),
    )


def build_model(
    cfg: JobConfig,
    spec: ModelSpec,
    model_args: object,
    mesh: DeviceMesh,
    dims: ParallelDims,
    flags: ParallelFlags,
    device: torch.device,
) -> nn.Module:
    """Return the parallelized, initialized model (seeded by training.seed, mesh-independent)."""
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    blocks = spec.blocks(model)
    if dims.tp > 1:
        apply_tensor_parallel(model, mesh["tp"], spec.root_tp_plan(flags.sequence_parallel, flags.loss_parallel))
        for block in blocks.values():
            apply_tensor_parallel(block, mesh["tp"], spec.block_tp_plan(flags.sequence_parallel))
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(blocks, ac.mode, ac.selective_ac_option)
    # apply_compile is a no-op unless [compile] enables it with "model" in components.
    if cfg.compile.strategy == "blocks":
        apply_compile(model, blocks, cfg.compile)
    apply_data_parallel(
        model,
        spec.fsdp_units(model),
        mesh,
        engine=flags.data_parallel_engine,
        param_dtype=flags.param_dtype,
        reduce_dtype=flags.reduce_dtype,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
    )
    if cfg.compile.strategy == "model":
        # A block compiled once and reused inside the whole-model graph; only without DTensors
        # (dp = tp = 1), where it works on torch 2.13 (docs/compile_and_ac.md).
        apply_compile(model, blocks, cfg.compile, fullgraph=flags.whole_graph, reuse_blocks=dims.world_size == 1)
    model.to_empty(device=device)
    torch.manual_seed(cfg.training.seed)
    with stored_parameters():  # initialize the parameters themselves, not their compute views
        model.init_weights(sharded_init_normal_, buffer_device=device)
    if cfg.compile.enable:
        # After data parallel: the engine's joint-graph pass is part of what the key names.
        key_compile_caches_by_process_groups(mesh, extra=joint_pass_cache_hash())
    return model
