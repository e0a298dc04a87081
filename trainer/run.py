"""One resolved run: every value that depends on several keys, the world size or a checkpoint.

`resolve_run` turns the raw config into a frozen `ResolvedRun` once, before any process group
exists, so that each mistake is found early and reported once, and so that the rest of the
trainer reads one answer instead of re-deriving it: the device, the mesh degrees, the
parallel flags that are actually in effect, the dtypes, the global batch and the number of
micro-batches, the model args, the folders, and the checkpoint step to resume from. Config
sections that need no resolution (optimizer, lr schedule, metrics, ...) are read from
`run.cfg` as they are.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from models import MODEL_NAMES, ModelSpec, get_model_spec
from parallel.activation_checkpoint import block_kinds, parse_per_block
from parallel.data_parallel import resolve_engine, traceable
from parallel.mesh import ParallelConfigError, ParallelDims
from trainer.checkpoint import complete_steps, read_trainer_state, step_dir
from trainer.config import DTYPES, Compile, JobConfig
from trainer.errors import CheckpointError, ConfigError
from trainer.initial_load import resolve_initial_load
from trainer.optim import optimizer_implementation, triton_available
from trainer.tokenizer import Tokenizer, build_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunPaths:
    """Output folders: relative keys live under `job.dump_folder`, absolute ones where they say."""

    dump: str
    checkpoint: str
    tensorboard: str
    traces: str
    memory_snapshots: str
    comm_traces: str  # flight-recorder dumps (comm.save_traces_folder)


@dataclass(frozen=True)
class ResolvedRun:
    cfg: JobConfig
    spec: ModelSpec
    model_args: Any
    tokenizer: Tokenizer
    device: torch.device
    dims: ParallelDims
    sequence_parallel: bool
    loss_parallel: bool
    fused_head_loss: bool  # the loss runs inside the head, chunk by chunk (training.head_loss resolved)
    compact_gradients: bool  # training.compact_gradients resolved: one GPU, bf16 compute, one micro-batch per step
    weight_copies: bool  # training.compute_weight_copies resolved: with compact gradients, forward reads kept bf16 weights
    overlap_step: bool  # optimizer.overlap_step resolved: each unit steps during the next forward (trainer/overlapped_step.py)
    backward_grad_norms: bool  # each unit's gradient norms taken during backward (parallel/backward_grad_norms.py)
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    data_parallel_engine: str  # "fully_shard" | "graph" ("auto" resolved)
    whole_graph: bool  # nothing in the model is hidden from the compiler (no FSDP2 hooks)
    global_batch_size: int  # sequences per optimizer step over all data-parallel ranks
    grad_accum_steps: int  # micro-batches per step on each data-parallel rank
    paths: RunPaths
    resume_step: int | None  # checkpoint step to resume from; None starts fresh
    initial_load_path: str | None  # Hugging Face weights to start from when nothing is resumed

    @property
    def dry_run(self) -> bool:
        """comm.mode = fake_backend: plan and estimate on this CPU, simulating the ranks; train nothing."""
        return self.cfg.comm.mode == "fake_backend"

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step trains on, over all ranks."""
        return self.global_batch_size * self.cfg.training.seq_len


def resolve_run(cfg: JobConfig, world_size: int) -> ResolvedRun:
    """Check everything that needs no process group and resolve the run; raises ConfigError
    (or CheckpointError) with one message naming the key and the fix."""
    spec = _model_spec(cfg)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path, cfg.model.hf_assets_path)
    model_args = _model_args(cfg, spec, tokenizer)
    dims = _parallel_dims(cfg, world_size, spec, model_args)
    device = _device(cfg)
    paths = _paths(cfg)
    resume_step = _resume_step(cfg, paths.checkpoint)
    global_batch = _global_batch_size(cfg, dims, paths.checkpoint, resume_step)
    _check_model_dependent(cfg, model_args)
    param = cfg.training.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if target_device_type(cfg) == "cuda" else "float32"
    p, c = cfg.parallelism, cfg.compile
    head_loss = cfg.training.head_loss
    if head_loss == "fused" and dims.tp > 1:
        raise ConfigError(
            "training.head_loss = 'fused' needs tensor_parallel_degree 1 (with tp > 1 the head is vocab-sharded "
            "and the loss runs on its logits); use 'separate'."
        )
    engine = resolve_engine(p.data_parallel_engine,
                            whole_model_compile=c.enable and c.strategy == "model" and "model" in c.components)
    if engine == "graph" and dims.dp_replicate > 1:
        raise ConfigError(
            "parallelism.data_parallel_engine = 'graph' shards over one data-parallel dim and does not do HSDP "
            "yet; with data_parallel_replicate_degree > 1 use data_parallel_engine = 'fully_shard' "
            "(or 'auto' with compile.strategy = 'blocks')."
        )
    compact = _compact_gradients(cfg, dims, DTYPES[param], global_batch)
    overlap_step = _overlap_step(cfg, dims, compact, _optimizer_implementation(cfg))
    return ResolvedRun(
        cfg=cfg,
        spec=spec,
        model_args=model_args,
        tokenizer=tokenizer,
        device=device,
        dims=dims,
        sequence_parallel=dims.tp > 1 and p.enable_sequence_parallel,
        loss_parallel=dims.tp > 1 and p.enable_loss_parallel,
        fused_head_loss=head_loss == "fused",
        compact_gradients=compact,
        weight_copies=_weight_copies(cfg, compact),
        overlap_step=overlap_step,
        backward_grad_norms=_backward_grad_norms(cfg, dims, overlap_step),
        param_dtype=DTYPES[param],
        reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce],
        data_parallel_engine=engine,
        whole_graph=traceable(engine, dims.dp),
        global_batch_size=global_batch,
        grad_accum_steps=global_batch // (cfg.training.local_batch_size * dims.dp),
        paths=paths,
        resume_step=resume_step,
        initial_load_path=resolve_initial_load(cfg.checkpoint.initial_load_path, cfg.checkpoint.initial_load_in_hf,
                                               cfg.checkpoint.initial_load_model_only),
    )


def _compact_gradients(cfg: JobConfig, dims: ParallelDims, param_dtype: torch.dtype, global_batch: int) -> bool:
    """training.compact_gradients resolved: it acts on one GPU (dp = tp = 1) with a compute dtype
    narrower than fp32, and there needs one micro-batch per step."""
    if not cfg.training.compact_gradients:
        return False
    if dims.dp * dims.tp > 1 or param_dtype.itemsize == 4:
        logger.info("training.compact_gradients has no effect here: it acts on one GPU (dp = tp = 1) with "
                    "bf16 compute; under FSDP2 the fp32 gradients are sharded already")
        return False
    if global_batch > cfg.training.local_batch_size:
        raise ConfigError(
            f"training.compact_gradients holds one micro-batch's gradients in {param_dtype}; with "
            f"global_batch_size {global_batch} = {global_batch // cfg.training.local_batch_size} micro-batches "
            "they would sum in it. Set training.compact_gradients = false, or global_batch_size = local_batch_size."
        )
    return True


def _weight_copies(cfg: JobConfig, compact_gradients: bool) -> bool:
    """training.compute_weight_copies resolved: the copies are the sinks compact gradients flow
    into, so they come with compact gradients (bf16 compute, the only one narrower than fp32),
    and like them act only where those do."""
    if not cfg.training.compute_weight_copies:
        return False
    if not cfg.training.compact_gradients:
        raise ConfigError("training.compute_weight_copies keeps the weight copies that compact gradients flow into; "
                          "set training.compact_gradients = true as well, or compute_weight_copies = false.")
    return compact_gradients


def _optimizer_implementation(cfg: JobConfig) -> str:
    """optimizer.implementation resolved; the Triton AdamW needs a GPU and triton."""
    implementation = optimizer_implementation(cfg.optimizer, target_device_type(cfg))
    if implementation == "triton":
        if target_device_type(cfg) != "cuda":
            raise ConfigError("optimizer.implementation = 'triton' runs on a GPU; on a CPU use 'auto' (foreach).")
        if not triton_available():
            raise ConfigError("optimizer.implementation = 'triton' needs the triton package (it comes with "
                              "torch's CUDA builds) and a C compiler (gcc, clang, or $CC); install them, or use 'fused'.")
    return implementation


def _overlap_step(cfg: JobConfig, dims: ParallelDims, compact_gradients: bool, optimizer_implementation: str) -> bool:
    """optimizer.overlap_step resolved. It applies without a data-parallel wrapper (dp = 1),
    whose hooks would gather parameters before the step is waited for, and without
    whole-model compile, whose graph the per-unit wait would break. With compact gradients it
    needs the Triton AdamW, which reads them where they are held; other implementations widen
    them group by group after backward. "auto" turns it on where it applies on a GPU (on a
    CPU there is nothing to overlap with); "on" where it does not is an error."""
    setting = cfg.optimizer.overlap_step
    if setting == "off":
        return False
    c = cfg.compile
    blockers = [
        (dims.dp > 1, f"data parallel degree {dims.dp} > 1 (it needs dp = 1)"),
        (c.enable and c.strategy == "model" and "model" in c.components, "compile.strategy = 'model'"),
        (compact_gradients and optimizer_implementation != "triton",
         "training.compact_gradients = true (unless optimizer.implementation = 'triton')"),
    ]
    reasons = [reason for blocked, reason in blockers if blocked]
    if setting == "on" and reasons:
        raise ConfigError(
            f"optimizer.overlap_step = 'on' does not work with {' and '.join(reasons)}; "
            "set optimizer.overlap_step = 'auto' or 'off'."
        )
    return not reasons and (setting == "on" or target_device_type(cfg) == "cuda")


def _backward_grad_norms(cfg: JobConfig, dims: ParallelDims, overlap_step: bool) -> bool:
    """Whether the clip's gradient norms are taken unit by unit during backward. The overlapped
    step needs them there. A step after backward gains too, where autograd makes each gradient
    (dp = 1, no data-parallel wrapper) and a GPU's side stream runs the norms beside backward's
    matmuls; not where the whole model is one compiled graph, which hands over every gradient
    at its end. The norms are the same bits either way."""
    c = cfg.compile
    whole_model = c.enable and c.strategy == "model" and "model" in c.components
    return overlap_step or (dims.dp == 1 and not whole_model and target_device_type(cfg) == "cuda")


def _model_spec(cfg: JobConfig) -> ModelSpec:
    if cfg.model.name not in MODEL_NAMES:
        raise ConfigError(f"model.name '{cfg.model.name}' is unknown; available: {', '.join(MODEL_NAMES)}.")
    spec = get_model_spec(cfg.model.name)
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor '{cfg.model.flavor}' is unknown for {cfg.model.name}; available: {', '.join(spec.flavors)}."
        )
    return spec


def _model_args(cfg: JobConfig, spec: ModelSpec, tokenizer: Tokenizer) -> Any:
    try:
        vocab_size = spec.vocab_size(tokenizer.n_words, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(f"{e}; raise model.vocab_size or set it to 0 (automatic).") from None
    return spec.build_args(cfg.model.flavor, vocab_size=vocab_size, max_seq_len=cfg.training.seq_len)


def _parallel_dims(cfg: JobConfig, world_size: int, spec: ModelSpec, model_args: Any) -> ParallelDims:
    p, seq_len = cfg.parallelism, cfg.training.seq_len
    try:
        dims = ParallelDims.resolve(world_size, p.data_parallel_replicate_degree, p.data_parallel_shard_degree,
                                    p.tensor_parallel_degree)
        if dims.tp > 1:
            dims.check_divisible(spec.tp_divisible_sizes(model_args))
    except ParallelConfigError as e:
        raise ConfigError(str(e)) from None
    if dims.tp > 1 and p.enable_sequence_parallel and seq_len % dims.tp:
        raise ConfigError(
            f"training.seq_len={seq_len} is not divisible by parallelism.tensor_parallel_degree={dims.tp} "
            "with sequence parallel on; use a multiple of the TP degree or --parallelism.no-enable_sequence_parallel."
        )
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if dims.tp > local_world and _is_rank0():
        logger.warning(
            f"parallelism.tensor_parallel_degree={dims.tp} is larger than the {local_world} processes per node: "
            "tensor-parallel collectives will cross the inter-node network; keep tp within a node."
        )
    return dims


def target_device_type(cfg: JobConfig) -> str:
    """The device type the run is for: where it runs, except that a dry run (which simulates
    the ranks on this CPU) plans for GPUs unless training.device says cpu."""
    if cfg.comm.mode == "fake_backend":
        return "cpu" if cfg.training.device == "cpu" else "cuda"
    return _device(cfg).type


def _device(cfg: JobConfig) -> torch.device:
    choice = cfg.training.device
    if cfg.comm.mode == "fake_backend":
        return torch.device("cpu")  # the dry run's simulated ranks live on this CPU, GPU or not
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no GPU is visible; use --training.device cpu or auto.")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _subfolder(dump: str, value: str, key: str) -> str:
    """`value` under `dump` when relative (it may not climb out with '..'); as given when absolute."""
    if os.path.isabs(value):
        return os.path.normpath(value)
    normalized = os.path.normpath(value)
    if normalized == ".." or normalized.startswith(".." + os.sep):
        raise ConfigError(
            f"{key} '{value}' leaves job.dump_folder through '..'; use a folder inside it, or an "
            "absolute path to write elsewhere (e.g. a checkpoint disk)."
        )
    return os.path.join(dump, normalized)


def _paths(cfg: JobConfig) -> RunPaths:
    dump = os.path.normpath(cfg.job.dump_folder)
    return RunPaths(
        dump=dump,
        checkpoint=_subfolder(dump, cfg.checkpoint.folder, "checkpoint.folder"),
        tensorboard=_subfolder(dump, cfg.metrics.save_tb_folder, "metrics.save_tb_folder"),
        traces=_subfolder(dump, cfg.profiling.save_traces_folder, "profiling.save_traces_folder"),
        memory_snapshots=_subfolder(
            dump, cfg.profiling.save_memory_snapshot_folder, "profiling.save_memory_snapshot_folder"
        ),
        comm_traces=_subfolder(dump, cfg.comm.save_traces_folder, "comm.save_traces_folder"),
    )


def _resume_step(cfg: JobConfig, folder: str) -> int | None:
    """The step `checkpoint.load_step` picks (-1: the newest complete one), or None."""
    if not cfg.checkpoint.enable:
        return None
    steps = complete_steps(folder)
    want = cfg.checkpoint.load_step
    if want == -1:
        return steps[-1] if steps else None
    if want not in steps:
        raise CheckpointError(
            f"checkpoint.load_step = {want} but {folder} has no complete step-{want} "
            f"(complete steps: {', '.join(map(str, steps)) or 'none'}). Pass one of those, or -1 for the newest."
        )
    return want


def _global_batch_size(cfg: JobConfig, dims: ParallelDims, folder: str, resume_step: int | None) -> int:
    """`training.global_batch_size`, where -1 means local_batch_size x dp for a fresh run and the
    checkpoint's value on resume, so that a run may resume on another world size."""
    t = cfg.training
    rows_per_micro_batch = t.local_batch_size * dims.dp
    global_batch = t.global_batch_size
    source = "training.global_batch_size"
    if global_batch == -1 and resume_step is not None:
        saved = (read_trainer_state(step_dir(folder, resume_step)).get("dataloader") or {}).get("global_batch_size")
        if saved is not None:
            global_batch, source = int(saved), f"the global batch of checkpoint step-{resume_step} (training.global_batch_size = -1)"
    if global_batch == -1:
        return rows_per_micro_batch
    if global_batch % rows_per_micro_batch:
        fix = max(rows_per_micro_batch, global_batch // rows_per_micro_batch * rows_per_micro_batch)
        raise ConfigError(
            f"{source} = {global_batch} must be a multiple of training.local_batch_size ({t.local_batch_size}) "
            f"x data-parallel degree ({dims.dp}) = {rows_per_micro_batch}. Set training.global_batch_size "
            f"to e.g. {fix}, or change training.local_batch_size."
        )
    return global_batch


def _check_model_dependent(cfg: JobConfig, model_args: Any) -> None:
    """Checks that need the model's size; warnings go to the log once (rank 0)."""
    ac = cfg.activation_checkpoint
    n_layers = getattr(model_args, "n_layers", None)
    if ac.mode == "selective" and ac.selective_ac_option != "op" and n_layers is not None:
        every = int(ac.selective_ac_option)
        if every > n_layers:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = {every} is larger than the model's {n_layers} "
                f"layers, so no block would be checkpointed; use 1..{n_layers}, or activation_checkpoint.mode = 'none'."
            )
    if ac.mode == "per_block" and n_layers is not None:
        try:
            parse_per_block(ac.per_block, n_layers)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if ac.per_block and ac.mode != "per_block" and _is_rank0():
        logger.warning(f"activation_checkpoint.per_block = '{ac.per_block}' has no effect with mode = '{ac.mode}': "
                       "it lays out the blocks of mode 'per_block'.")
    if ac.offload_blocks and n_layers is not None:
        _check_activation_offload(cfg, n_layers)
    op_sac = ac.mode == "selective" and ac.selective_ac_option == "op"
    if ac.op_sac_matmuls != "alternate" and not op_sac and _is_rank0():
        logger.warning(
            f"activation_checkpoint.op_sac_matmuls = '{ac.op_sac_matmuls}' has no effect with mode = '{ac.mode}': "
            "it chooses what op SAC saves (mode 'selective', selective_ac_option 'op')."
        )
    t, warmup = cfg.training, cfg.lr_scheduler.warmup_steps
    if warmup > t.steps and _is_rank0():
        logger.warning(
            f"lr_scheduler.warmup_steps ({warmup}) > training.steps ({t.steps}): the learning rate never "
            f"reaches optimizer.lr (it ends at {t.steps / (warmup + 1):.0%} of it)."
        )


def offload_reaches_every_block(c: Compile) -> bool:
    """Whether activation offload can take any block's activations, checkpointed or not: a block
    compiled per block through AOTAutograd is one autograd node, whose saved tensors the offload
    hooks see. The "eager" backends (eager, eager_debug, eager_noexcept) run dynamo's graph
    without AOTAutograd, so a checkpoint in it is an eager one, whose tensors they do not see."""
    return c.enable and "model" in c.components and c.strategy == "blocks" and not c.backend.startswith("eager")


def _check_activation_offload(cfg: JobConfig, n_layers: int) -> None:
    """activation_checkpoint.offload_blocks: the hooks it relies on see a block's saved tensors
    only where the block is one compiled node or runs eagerly without checkpointing
    (parallel/activation_offload.py)."""
    ac, c = cfg.activation_checkpoint, cfg.compile
    n = ac.offload_blocks
    if not 0 <= n < n_layers:
        raise ConfigError(
            f"activation_checkpoint.offload_blocks = {n}: use 0..{n_layers - 1} (the model has {n_layers} blocks, "
            "and the last block's activations are the first backward reads)."
        )
    if c.enable and "model" in c.components and c.strategy == "model":
        raise ConfigError(
            "activation_checkpoint.offload_blocks needs compile.strategy = 'blocks' or compile.enable = false: "
            "under whole-model compile the saved activations are handed over only after the whole forward."
        )
    try:
        kinds = block_kinds(n_layers, ac.mode, ac.selective_ac_option, ac.op_sac_matmuls, ac.per_block)[:n]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not offload_reaches_every_block(c) and any(kind != "none" for kind in kinds):
        raise ConfigError(
            f"activation_checkpoint.offload_blocks = {n} with eager checkpointed blocks: checkpointing keeps their "
            "activations where offloading cannot reach them; compile the blocks (compile.enable = true, "
            "strategy 'blocks', a backend with AOTAutograd such as 'inductor') or leave the offloaded blocks unwrapped "
            "(mode 'per_block' with none:N first)."
        )


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0
