"""The dry run (`comm.mode = "fake_backend"`): plan a job of N GPUs on one CPU, then exit.

`NGPU=64 COMM_MODE=fake_backend CONFIG_FILE=X.toml ./run_train.sh` (torchtitan's spelling) runs
`train.py --comm.mode fake_backend --comm.fake_world_size 64` in one process. It resolves the
run exactly as training would, starts PyTorch's fake process group as rank 0 of N, builds the
meshes and the model on the meta device with the full plan applied by the trainer's own
`parallelize_model` (TP, activation checkpointing, compile wrappers, data parallel; nothing is
allocated, initialized or compiled), and prints the mesh, every parameter group's placements
and local shape, the per-rank memory by phase of a step, and a step-time estimate. A config
the real run would refuse is refused the same way, in one line, with exit code 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Callable

import torch.distributed as dist
from torch import nn

from parallel.activation_checkpoint import BLOCK_KINDS, checkpoint_kind
from parallel.activation_offload import blocks_on_device_in_forward, most_useful_count
from parallel.compile import fuses_loss
from parallel.data_parallel import cast_views
from parallel.memory import (
    GIB,
    ActivationInputs,
    MemoryEstimate,
    ParamGroup,
    UnitBytes,
    cast_copy_bytes,
    estimate_memory,
    parameter_groups,
    state_bytes,
    unit_bytes,
)
from trainer.build import parallelize_model
from trainer.comm import init_fake_process_group
from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.optim import optimizer_implementation
from trainer.run import ResolvedRun, offload_reaches_every_block, resolve_run, target_device_type


# The share of GPU memory the estimated peak may take and still "fit": the allocator reserves more.
FITS = 0.9
# The kinds a layout found with activation offload may use. Offload buys back recompute; past
# "op_all" (every matmul output saved) a block saves only the elementwise recompute, for about
# 1.7x the activations through the host link (3B, seq 8192, local batch 2: 1.60 against 0.95 GiB).
OFFLOAD_KINDS = BLOCK_KINDS[:BLOCK_KINDS.index("op_all") + 1]


@dataclass(frozen=True)
class FittingLayout:
    """A per_block layout whose estimated peak fits the GPU the dry run was given."""
    layout: str  # activation_checkpoint.per_block
    kinds: tuple[str, ...]
    estimate: MemoryEstimate
    offload_blocks: int = 0
    offloaded_bytes: int = 0  # the offloaded blocks' activations, to host memory and back each step

    @property
    def saved(self) -> int:
        """How much the layout saves: BLOCK_KINDS climb from least to most saved, so a higher sum
        recomputes less."""
        return sum(BLOCK_KINDS.index(kind) for kind in self.kinds)


@dataclass(frozen=True)
class DryRunPlan:
    run: ResolvedRun
    groups: list[ParamGroup]
    units: list[UnitBytes]
    block_kinds: list[str]
    memory: MemoryEstimate
    num_params: int
    flops_per_token: float
    fitting_layout: FittingLayout | None = None  # with comm.dry_run_gpu_memory_gib only
    offload_layout: FittingLayout | None = None  # one that saves more by offloading the first blocks


def world_size_for(cfg: JobConfig) -> int:
    """comm.fake_world_size, else the NGPU environment variable run_train.sh passes on."""
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker torchrun started
        raise ConfigError(
            "comm.mode = 'fake_backend' is a dry run in one process; run it without torchrun: "
            "COMM_MODE=fake_backend NGPU=N ./run_train.sh, or python train.py ... --comm.fake_world_size N."
        )
    if cfg.comm.fake_world_size:
        return cfg.comm.fake_world_size
    ngpu = os.environ.get("NGPU", "")
    if ngpu.isdigit() and int(ngpu) > 0:
        return int(ngpu)
    raise ConfigError(
        "comm.mode = 'fake_backend' needs the number of GPUs to simulate: set comm.fake_world_size "
        "(e.g. --comm.fake_world_size 64) or the NGPU environment variable."
    )


def plan(cfg: JobConfig, world_size: int) -> DryRunPlan:
    """Resolve, build on the fake process group as rank 0 of `world_size`, and estimate."""
    run = resolve_run(cfg, world_size)
    init_fake_process_group(world_size)
    try:
        meshes = run.dims.build_meshes("cpu")
        model = parallelize_model(run, meshes)
        return _plan_of(run, model)
    finally:
        dist.destroy_process_group()


def _plan_of(run: ResolvedRun, model: nn.Module) -> DryRunPlan:
    cfg, spec = run.cfg, run.spec
    device_type = target_device_type(cfg)
    blocks = spec.blocks(model)
    block_modules = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    kinds = [checkpoint_kind(block) for block in block_modules]
    inputs = ActivationInputs(
        tokens=cfg.training.local_batch_size * cfg.training.seq_len,
        tp=run.dims.tp,
        sequence_parallel=run.sequence_parallel,
        loss_parallel=run.loss_parallel,
        compute_bytes=run.param_dtype.itemsize,
        compiled=cfg.compile.enable and "model" in cfg.compile.components,
        fused_norm=device_type == "cuda",
    )
    units = unit_bytes(spec.fsdp_units(model), model, run.param_dtype, run.reduce_dtype)
    if run.weight_copies:  # forward reads the kept weight copies: autograd keeps no cast of its own
        units = [replace(unit, compute_copies=0) for unit in units]
    implementation = optimizer_implementation(cfg.optimizer, device_type)
    state = state_bytes(model, [p for p, _ in cast_views(model)] if run.compact_gradients else [], run.param_dtype,
                        widens=implementation != "triton", weight_copies=run.weight_copies)
    # Cast copies: the built layout's, minus its unwrapped blocks', plus those of the layout asked about.
    block_casts = [0 if run.weight_copies else cast_copy_bytes(block, run.param_dtype) for block in block_modules]

    def kept_casts(block_kinds: list[str]) -> list[int]:
        """Each block's cast copies autograd keeps: only an unwrapped block keeps them."""
        return [cast if kind == "none" else 0 for cast, kind in zip(block_casts, block_kinds)]

    outside_casts = sum(u.compute_copies for u in units) - sum(kept_casts(kinds))
    per_kind = {kind: spec.activation_bytes(run.model_args, inputs, [kind]).blocks for kind in BLOCK_KINDS}

    def offloaded_bytes(block_kinds: list[str], offload: int) -> tuple[int, int]:
        """The first `offload` blocks' activations (cast copies included), and how many more
        bytes of block activations forward holds on the device at its worst than at its end
        (offloaded blocks not released yet)."""
        if not offload:
            return 0, 0
        sizes = [per_kind[kind] + cast for kind, cast in zip(block_kinds, kept_casts(block_kinds))]
        at_end = sum(sizes[offload:])
        worst = max(sum(sizes[b] for b in alive) for alive in blocks_on_device_in_forward(offload, len(sizes)))
        return sum(sizes[:offload]), max(worst - at_end, 0)

    def estimate(block_kinds: list[str], offload: int) -> MemoryEstimate:
        offloaded, unreleased = offloaded_bytes(block_kinds, offload)
        return estimate_memory(
            state,
            units,
            spec.activation_bytes(run.model_args, inputs, block_kinds),
            inputs,
            real_columns=run.tokenizer.n_words,
            compiled_loss=cfg.compile.enable and "loss" in cfg.compile.components,
            loss_in_model_graph=fuses_loss(cfg.compile),
            grad_accum_steps=run.grad_accum_steps,
            defer_reduce_scatter=cfg.parallelism.gradient_sync == "step",
            reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
            foreach_optimizer=implementation == "foreach",
            fused_head=run.fused_head_loss,
            cast_copies=outside_casts + sum(kept_casts(block_kinds)),
            offloaded=offloaded,
            offload_unreleased=unreleased,
        )

    def fitting_with(offload: int, kinds_to_try: tuple[str, ...] = BLOCK_KINDS) -> FittingLayout | None:
        found = _most_memory_that_fits(lambda block_kinds: estimate(block_kinds, offload), len(kinds),
                                       cfg.comm.dry_run_gpu_memory_gib * GIB, kinds_to_try)
        if found is None or not offload:
            return found
        return replace(found, offload_blocks=offload, offloaded_bytes=offloaded_bytes(list(found.kinds), offload)[0])

    configured = cfg.activation_checkpoint.offload_blocks
    fitting = offloading = None
    if cfg.comm.dry_run_gpu_memory_gib:
        fitting = fitting_with(configured)
        if offload_reaches_every_block(cfg.compile):
            counts = range(1, most_useful_count(len(kinds)) + 1)
            offloading = _most_saved([fitting_with(count, OFFLOAD_KINDS) for count in counts])
            if offloading is not None and fitting is not None and offloading.saved <= fitting.saved:
                offloading = None
    return DryRunPlan(run=run, groups=parameter_groups(model), units=units, block_kinds=kinds,
                      memory=estimate(kinds, configured), num_params=model.num_params(),
                      flops_per_token=model.flops_per_token(cfg.training.seq_len),
                      fitting_layout=fitting, offload_layout=offloading)


def _most_saved(candidates: list[FittingLayout | None]) -> FittingLayout | None:
    """The candidate that saves the most; of equals, the first (the fewest blocks offloaded:
    each costs host-link time and pinned memory): `max` returns the first of equals."""
    return max((c for c in candidates if c is not None), key=lambda c: c.saved, default=None)


def _most_memory_that_fits(estimate: Callable[[list[str]], MemoryEstimate], n_blocks: int,
                           gpu_bytes: float, kinds_to_try: tuple[str, ...] = BLOCK_KINDS) -> FittingLayout | None:
    """The `activation_checkpoint.per_block` layout that saves the most activations (so
    backward recomputes the least) and whose peak still fits in 90% of `gpu_bytes` (the
    "fits" line), with its estimate; None if not even full AC on every block fits.

    Kinds climb `kinds_to_try` (a prefix of BLOCK_KINDS: full, op, op_all, none): every block
    takes the highest kind that fits on all of them, then as many blocks as fit take the next one."""
    def layout_of(upper: str, k: int, lower: str) -> list[str]:
        return [upper] * k + [lower] * (n_blocks - k)

    def fits(kinds: list[str]) -> bool:
        return estimate(kinds).peak.total <= FITS * gpu_bytes

    levels = [kind for kind in kinds_to_try if fits([kind] * n_blocks)]
    if not levels:
        return None
    lower = levels[-1]
    kinds = [lower] * n_blocks
    if lower != kinds_to_try[-1]:
        upper = kinds_to_try[kinds_to_try.index(lower) + 1]
        k = max(k for k in range(n_blocks) if fits(layout_of(upper, k, lower)))
        kinds = layout_of(upper, k, lower)
    layout = ",".join(f"{kind}:{kinds.count(kind)}" for kind in dict.fromkeys(kinds))
    return FittingLayout(layout, tuple(kinds), estimate(kinds))


def dry_run(cfg: JobConfig) -> int:
    """Entry point from trainer/main.py: print the plan and return the exit code (0)."""
    print(format_plan(plan(cfg, world_size_for(cfg))), flush=True)
    return 0


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _ac_summary(kinds: list[str]) -> str:
    names = {"full": "full", "op": "selective op", "op_all": "selective op (every matmul saved)", "none": "none"}
    counts = {k: kinds.count(k) for k in names if kinds.count(k)}
    return ", ".join(f"{names[k]} on {n} of {len(kinds)} blocks" for k, n in counts.items())


def _dp_traffic(p: DryRunPlan) -> tuple[int, int]:
    """Bytes this rank sends per step for data parallelism (ring algorithms): over dp_shard, the
    all-gathers of forward and backward (each micro-batch) and one reduce-scatter (per step, or
    per micro-batch with gradient_sync = microbatch); over dp_replicate, the gradient all-reduce."""
    dims, run = p.run.dims, p.run
    shard_share = (dims.dp_shard - 1) / dims.dp_shard
    gathered = sum(u.gathered for u in p.units)
    reduce = sum(u.reduce_buffer for u in p.units)
    reductions = 1 if run.cfg.parallelism.gradient_sync == "step" else run.grad_accum_steps
    over_shard = shard_share * (2 * gathered * run.grad_accum_steps + reduce * reductions)
    over_replicate = 2 * (dims.dp_replicate - 1) / dims.dp_replicate * reduce / dims.dp_shard
    return int(over_shard), int(over_replicate)


def format_plan(p: DryRunPlan) -> str:
    run, cfg, dims, m = p.run, p.run.cfg, p.run.dims, p.memory
    t, c = cfg.training, cfg.comm
    offload_n = cfg.activation_checkpoint.offload_blocks
    on = {True: "on", False: "off"}
    lines = [
        f"dry run: {cfg.model.name} {cfg.model.flavor} on {dims.world_size} simulated ranks "
        f"(fake process group in one CPU process; nothing was allocated, compiled or trained)",
        f"mesh: dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} x tp {dims.tp} "
        f"(outermost to innermost) = {dims.world_size} ranks; data parallel {dims.dp}",
        f"  sequence parallel {on[run.sequence_parallel]}, loss parallel {on[run.loss_parallel]}; "
        f"parameters {_dtype(p.groups)}, compute {_name(run.param_dtype)}, gradient reduce {_name(run.reduce_dtype)}",
        f"  batch: {t.local_batch_size} x {t.seq_len} tokens per micro-batch per data-parallel rank, "
        f"{run.grad_accum_steps} micro-batch(es) per step (gradient_sync {cfg.parallelism.gradient_sync}); "
        f"global {run.global_batch_size} sequences = {run.tokens_per_step:,} tokens per step",
        f"  activation checkpointing: {_ac_summary(p.block_kinds)}; compile: "
        + (f"{cfg.compile.strategy} ({', '.join(cfg.compile.components)}), applied, compiled at the first step"
           if cfg.compile.enable else "off"),
        "",
        f"parameters (rank 0 of {dims.world_size}):",
    ]
    rows = [("name", "n", "global shape", "local shape", "placements", "local MiB")]
    rows += [(g.name, str(g.count), _shape(g.global_shape), _shape(g.local_shape), g.placements,
              f"{g.local_bytes / 2**20:,.1f}") for g in p.groups]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  " + "  ".join(cell.ljust(w) if i != 5 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
              for r in rows]
    local_params = sum(g.local_numel for g in p.groups)
    lines += [f"  {p.num_params:,} parameters; {local_params:,} on rank 0", ""]

    s = m.state
    loss_fwd, _, loss_bwd = m.loss
    lines += [
        "memory per rank (rank 0 holds the largest shards; parameters, gradients and optimizer state are exact,",
        "the rest is estimated: docs/planning.md says how and how well):",
        f"  parameters            {s.params:>18,} B  {_gib(s.params):>12}",
        f"  gradients             {s.grads:>18,} B  {_gib(s.grads):>12}"
        + ("  at the end of backward, compact (training.compact_gradients); "
           + (f"widened to fp32 {_gib(s.widened_grads)} at a time by the step" if s.widened_grads
              else "read as held by the Triton AdamW") if run.compact_gradients else ""),
        *([f"  weight copies         {s.weight_copies:>18,} B  {_gib(s.weight_copies):>12}  {_name(run.param_dtype)}, "
           "read by forward instead of a cast (training.compute_weight_copies)"] if s.weight_copies else []),
        f"  optimizer state       {s.optimizer:>18,} B  {_gib(s.optimizer):>12}  AdamW exp_avg + exp_avg_sq + step",
        f"  activations           {m.activation_total:>18,} B  {_gib(m.activation_total):>12}  one micro-batch, "
        f"saved for backward" + (f", on the GPU (the first {offload_n} blocks' are held in host memory: "
                                 f"activation_checkpoint.offload_blocks)" if offload_n else ""),
        f"  logits + loss         {loss_bwd:>18,} B  {_gib(loss_bwd):>12}  backward peak "
        f"(forward {_gib(loss_fwd)}; loss {'compiled' if cfg.compile.enable and 'loss' in cfg.compile.components else 'eager'}"
        f"{', fused into the head' if run.fused_head_loss else ''})",
        f"  largest gathered unit {m.largest_gathered:>18,} B  {_gib(m.largest_gathered):>12}  "
        f"data-parallel all-gather in {_name(run.param_dtype)}",
    ]
    if m.accumulated_grads:
        lines.append(f"  accumulated gradients {m.accumulated_grads:>18,} B  {_gib(m.accumulated_grads):>12}  held "
                     f"between micro-batches (gradient_sync {cfg.parallelism.gradient_sync})")
    lines += ["", "peak by phase of a step:"]
    peak = m.peak
    for phase in m.phases:
        mark = "  <- peak" if phase is peak else ""
        lines.append(f"  {phase.name:<26} {_gib(phase.total):>12}{mark}")
    parts = ", ".join(f"{name} {_gib(v)}" for name, v in peak.parts.items() if v)
    lines.append(f"  peak {_gib(peak.total)} = {parts}")
    if c.dry_run_gpu_memory_gib:
        share = peak.total / GIB / c.dry_run_gpu_memory_gib
        verdict = "fits in" if share <= FITS else ("is tight in" if share <= 1.0 else "DOES NOT FIT in")
        lines.append(f"  {verdict} {c.dry_run_gpu_memory_gib:g} GiB per GPU ({share:.0%}; the allocator reserves more "
                     "than it hands out: keep 10% or more free)")
    if p.fitting_layout is not None:
        fitting = p.fitting_layout
        lines.append(f"  the most activations that fit: activation_checkpoint.mode = 'per_block', "
                     f"per_block = '{fitting.layout}' (peak {_gib(fitting.estimate.peak.total)}; the more saved, "
                     "the less backward recomputes)")
    elif c.dry_run_gpu_memory_gib:
        lines.append(f"  not even full activation checkpointing on every block fits in {FITS:.0%} of it: "
                     "shard more (data_parallel_shard_degree, tensor_parallel_degree) or lower the local batch")
    if p.offload_layout is not None:
        offloading = p.offload_layout
        lines.append(f"  with activation offload: activation_checkpoint.offload_blocks = {offloading.offload_blocks}, "
                     f"per_block = '{offloading.layout}' (peak {_gib(offloading.estimate.peak.total)}; "
                     f"{_gib(offloading.offloaded_bytes)} to host memory and back each step; docs/compile_and_ac.md)")
    over_shard, over_replicate = _dp_traffic(p)
    lines += ["", f"data-parallel traffic per rank per step: {_gib(over_shard)} over dp_shard (all-gathers, "
                  f"reduce-scatter), {_gib(over_replicate)} over dp_replicate (all-reduce)"]

    per_gpu = c.dry_run_mfu * c.dry_run_peak_tflops * 1e12 / p.flops_per_token
    total = per_gpu * dims.world_size
    lines += [
        "",
        f"time: {p.flops_per_token / 1e9:,.2f} GFLOP per token (6 x non-embedding parameters + 12 x layers x dim x "
        f"seq_len); at {c.dry_run_mfu:.0%} MFU of {c.dry_run_peak_tflops:g} TFLOP/s (comm.dry_run_mfu, "
        "comm.dry_run_peak_tflops):",
        f"  {per_gpu:,.0f} tokens/s per GPU, {total:,.0f} tokens/s in all, {run.tokens_per_step / total:,.2f} s per "
        f"step, {total * 86400 / 1e9:,.2f} B tokens/day",
    ]
    return "\n".join(lines)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(groups: list[ParamGroup]) -> str:
    return "/".join(sorted({_name(g.dtype) for g in groups}))
