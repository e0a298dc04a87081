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

import torch
from torch import nn

from parallel.activation_checkpoint import apply_activation_checkpointing, set_activation_memory_budget
from parallel.compile import apply_compile, compile_loss, key_compile_caches_by_process_groups
from parallel.data_parallel import apply_data_parallel
from parallel.init import sharded_init_normal_
from parallel.loss import chunk_loss_and_grad, fuse_loss_into_head
from parallel.mesh import Meshes
from parallel.parameter_views import stored_parameters
from parallel.torch_internals import cache_graphs_with_autograd_functions, joint_pass_cache_hash
from parallel.tensor_parallel import apply_tensor_parallel
from trainer.run import ResolvedRun


def build_model(run: ResolvedRun, meshes: Meshes) -> nn.Module:
    """Return the parallelized, initialized model (seeded by training.seed, mesh-independent)."""
    model = parallelize_model(run, meshes)
    model.to_empty(device=run.device)
    torch.manual_seed(run.cfg.training.seed)
    with stored_parameters():  # initialize the parameters themselves, not their compute views
        model.init_weights(sharded_init_normal_, buffer_device=run.device)
    return model


def parallelize_model(run: ResolvedRun, meshes: Meshes) -> nn.Module:
    """The model on the meta device with the whole plan applied (TP, AC, compile wrappers, data
    parallel) and nothing allocated: what the dry run inspects, and what build_model materializes."""
    cfg, spec = run.cfg, run.spec
    with torch.device("meta"):
        model = spec.model_cls(run.model_args)
    if run.fused_head_loss:
        # Before any wrapper: FSDP2 and parameter views subclass the head's class as they find it.
        fuse_loss_into_head(spec.head(model), run.tokenizer.n_words, compile_loss(chunk_loss_and_grad, cfg.compile))
    blocks = spec.blocks(model)
    if run.dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, spec.root_tp_plan(run.sequence_parallel, run.loss_parallel))
        for block in blocks.values():
            apply_tensor_parallel(block, meshes.tp, spec.block_tp_plan(run.sequence_parallel))
    ac = cfg.activation_checkpoint
    apply_activation_checkpointing(blocks, ac.mode, ac.selective_ac_option, ac.op_sac_matmuls, ac.per_block)
    set_activation_memory_budget(ac.memory_budget if ac.mode == "memory_budget" else 1.0)
    # apply_compile is a no-op unless [compile] enables it with "model" in components.
    if cfg.compile.strategy == "blocks":
        apply_compile(model, blocks, cfg.compile)
    apply_data_parallel(
        model,
        spec.fsdp_units(model),
        meshes,
        engine=run.data_parallel_engine,
        param_dtype=run.param_dtype,
        reduce_dtype=run.reduce_dtype,
        reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
    )
    if cfg.compile.strategy == "model":
        # A block compiled once and reused inside the whole-model graph; only without DTensors
        # (dp = tp = 1), where it works on torch 2.13 (docs/compile_and_ac.md).
        apply_compile(model, blocks, cfg.compile, fullgraph=run.whole_graph, reuse_blocks=run.dims.world_size == 1)
    if cfg.compile.enable:
        # After data parallel: the engine's joint-graph pass is part of what the key names.
        key_compile_caches_by_process_groups(meshes.world, extra=joint_pass_cache_hash())
        cache_graphs_with_autograd_functions()
    return model
