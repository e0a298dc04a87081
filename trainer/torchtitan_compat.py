"""torchtitan v0.2.2 job-config keys: what weft does with each one, in one table.

A torchtitan user's TOML should load here unmodified. `TABLE` names every key of torchtitan
v0.2.2's `JobConfig` (tests check it against that release's `job_config.py`) and says one of:

- **supported**: weft has the same key with the same meaning; `trainer/config.py` handles it.
- **alias**: weft has the same feature under another name (`debug.seed` -> `training.seed`).
- **neutral**: weft lacks the feature. The key is accepted at the value that leaves the
  feature off (degree 1, `enable = false`, an empty list, ...) and listed once at start as
  ignored; any other value is refused, all such keys together in one error that says what
  weft offers instead. A `gate` makes a key inert while another key keeps its feature off
  (a pipeline schedule while `pipeline_parallel_degree = 1`): then any value is accepted.

When weft grows one of these features (HSDP's `data_parallel_replicate_degree`, `[comm]`),
its own key takes over at once, since `trainer/config.py` looks weft's keys up first;
flipping the line here to `SUPPORTED` is then the whole change, and
tests/test_torchtitan_compat.py fails until it is made. `VALUE_MAP` translates the
few torchtitan values that name torchtitan's own assets into weft's equivalents, with a note.
`docs/torchtitan_compat.md` is generated from this module (scripts/torchtitan_compat_doc.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from trainer.errors import ConfigError

SUPPORTED_ACTION, ALIAS_ACTION, NEUTRAL_ACTION = "supported", "alias", "neutral"
ANY = object()  # in `Key.neutral`: every value is accepted (the key cannot change what weft does)
DOC = "docs/torchtitan_compat.md"


@dataclass(frozen=True)
class Key:
    action: str
    why: str = ""  # alias / neutral: what weft does instead, shown in the error and the docs
    target: str = ""  # alias: the weft key
    invert: bool = False  # alias: the weft flag means the opposite (disable_* -> enable_*)
    default: Any = None  # neutral: torchtitan's default; its type parses command-line values
    neutral: tuple = ()  # neutral: the accepted values
    gate: tuple[str, tuple] | None = None  # (key, values that keep its feature off)

    def accepts(self, value: Any, gate_off: bool) -> bool:
        return ANY in self.neutral or gate_off or any(_same(value, v) for v in self.neutral)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b  # so that true never passes for 1


SUPPORTED = Key(SUPPORTED_ACTION)


def supported(why: str) -> Key:
    """Supported, with a difference worth a line in the docs."""
    return Key(SUPPORTED_ACTION, why=why)


def alias(target: str, why: str = "", invert: bool = False) -> Key:
    return Key(ALIAS_ACTION, why=why, target=target, invert=invert)


def neutral(default: Any, why: str, also: tuple = (), gate: tuple[str, tuple] | None = None) -> Key:
    """Accepted at torchtitan's `default` (and `also`); other values are refused with `why`."""
    return Key(NEUTRAL_ACTION, why=why, default=default, neutral=(default, *also), gate=gate)


def inert(default: Any, why: str) -> Key:
    """Accepted at any value: the key cannot change what weft does (`why` says why)."""
    return Key(NEUTRAL_ACTION, why=why, default=default, neutral=(ANY,))


# Gates: a key whose values listed here keep a feature off.
PIPELINE = ("parallelism.pipeline_parallel_degree", (1,))
CONTEXT = ("parallelism.context_parallel_degree", (1,))
EXPERT = ("parallelism.expert_parallel_degree", (1,))
CONVERTERS = ("model.converters", ([],))
INITIAL_LOAD = ("checkpoint.initial_load_path", (None, ""))
FAULT_TOLERANCE = ("fault_tolerance.enable", (False,))
VALIDATION = ("validation.enable", (False,))
TRAIN_WORKERS = ("training.dataloader.num_workers", (0,))
VAL_WORKERS = ("validation.dataloader.num_workers", (0,))

_PP = ("pipeline parallelism is not in weft; make data_parallel_shard_degree x tensor_parallel_degree the "
       "world size (FSDP + TP) and use activation_checkpoint.mode = full for memory")
_CP = "context parallelism is not in weft; shorten training.seq_len or add tensor parallelism with sequence parallel"
_EP = "expert parallelism is for MoE models; weft's Llama 3 is dense"
_CONVERT = ("model converters (float8 / MX training) are not in weft; it trains with bf16 or fp32 mixed "
            "precision (training.mixed_precision_param)")
_INITIAL_LOAD = "weft starts from unquantized Hugging Face safetensors only (checkpoint.initial_load_in_hf)"
_FT = "fault tolerance (TorchFT) is not in weft; checkpoints plus a restart resume the run"
_WORKERS = "weft's loader cuts pre-tokenized, memory-mapped windows in the training process; it needs no workers"
_VAL_SHAPE = "weft validates with training.local_batch_size and training.seq_len"

TABLE: dict[str, Key] = {
    # [job]
    "job.config_file": SUPPORTED,
    "job.dump_folder": SUPPORTED,
    "job.description": SUPPORTED,
    "job.print_config": inert(False, "weft always prints the resolved config at start and saves it to <dump_folder>/config.toml"),
    "job.save_config_file": neutral(None, "weft always saves the resolved config to <dump_folder>/config.toml"),
    "job.custom_config_module": neutral("", "weft has no config extension modules; its keys live in trainer/config.py"),
    # [profiling]
    "profiling.enable_profiling": SUPPORTED,
    "profiling.save_traces_folder": SUPPORTED,
    "profiling.profile_freq": SUPPORTED,
    "profiling.profiler_active": neutral(1, "weft traces one step every profiling.profile_freq steps"),
    "profiling.profiler_warmup": inert(3, "weft warms the profiler up for the one step before each traced step"),
    "profiling.enable_memory_snapshot": SUPPORTED,
    "profiling.save_memory_snapshot_folder": SUPPORTED,
    # [metrics]
    "metrics.log_freq": SUPPORTED,
    "metrics.enable_tensorboard": supported("weft's default is true"),
    "metrics.disable_color_printing": inert(False, "weft's console output has no colors"),
    "metrics.save_tb_folder": SUPPORTED,
    "metrics.save_for_all_ranks": neutral(False, "weft writes metrics from rank 0 (the loss is the mean over data-parallel ranks)"),
    "metrics.enable_wandb": neutral(False, "Weights & Biases is not in weft; use TensorBoard (metrics.enable_tensorboard) or metrics.jsonl"),
    # [model]
    "model.name": SUPPORTED,
    "model.flavor": SUPPORTED,
    "model.hf_assets_path": supported(
        "weft reads the tokenizer from it: tokenizer.model or original/tokenizer.model (tiktoken); not tokenizer.json"),
    "model.tokenizer_path": supported(
        "a tiktoken file (a folder is read like model.hf_assets_path); when set, it wins over model.hf_assets_path"),
    "model.converters": neutral([], _CONVERT),
    "model.print_after_conversion": neutral(False, _CONVERT, gate=CONVERTERS),
    # [optimizer]
    "optimizer.name": SUPPORTED,
    "optimizer.lr": SUPPORTED,
    "optimizer.beta1": SUPPORTED,
    "optimizer.beta2": SUPPORTED,
    "optimizer.eps": SUPPORTED,
    "optimizer.weight_decay": SUPPORTED,
    "optimizer.implementation": supported("weft's default is auto: its Triton AdamW on CUDA (fused without triton), foreach on CPU"),
    "optimizer.early_step_in_backward": neutral(False, "weft steps the optimizer after backward, with gradient clipping"),
    # [lr_scheduler]
    "lr_scheduler.warmup_steps": SUPPORTED,
    "lr_scheduler.total_steps": neutral(None, "weft's schedule spans training.steps; set training.steps"),
    "lr_scheduler.decay_ratio": SUPPORTED,
    "lr_scheduler.decay_type": supported("linear, cosine (weft also has constant); sqrt is refused"),
    "lr_scheduler.min_lr_factor": SUPPORTED,
    # [training]
    "training.dataset": SUPPORTED,
    "training.dataset_path": SUPPORTED,
    "training.local_batch_size": SUPPORTED,
    "training.global_batch_size": SUPPORTED,
    "training.seq_len": SUPPORTED,
    "training.max_norm": SUPPORTED,
    "training.steps": SUPPORTED,
    "training.enable_cpu_offload": neutral(False, "FSDP CPU offload is not in weft; add data-parallel ranks or activation checkpointing"),
    "training.dtype": neutral("float32", "weft keeps fp32 master weights; use training.mixed_precision_param = bfloat16"),
    "training.mixed_precision_param": supported("weft's default is auto: bfloat16 on GPU, float32 on CPU"),
    "training.mixed_precision_reduce": SUPPORTED,
    "training.gc_freq": SUPPORTED,
    "training.gc_debug": neutral(False, "weft has no GC debug mode; it collects every training.gc_freq steps"),
    "training.dataloader.num_workers": neutral(0, _WORKERS),
    "training.dataloader.persistent_workers": neutral(False, _WORKERS, gate=TRAIN_WORKERS),
    "training.dataloader.pin_memory": inert(False, "weft copies batches from pinned memory whenever it trains on CUDA"),
    "training.dataloader.prefetch_factor": neutral(None, _WORKERS, gate=TRAIN_WORKERS),
    # [parallelism]
    "parallelism.data_parallel_replicate_degree": SUPPORTED,
    "parallelism.data_parallel_shard_degree": SUPPORTED,
    "parallelism.fsdp_reshard_after_forward": SUPPORTED,
    "parallelism.tensor_parallel_degree": SUPPORTED,
    "parallelism.disable_loss_parallel": alias("parallelism.enable_loss_parallel", invert=True),
    "parallelism.enable_async_tensor_parallel": neutral(
        False, "async tensor parallel is not in weft; its TP collectives run synchronously"),
    "parallelism.pipeline_parallel_degree": neutral(1, _PP),
    "parallelism.module_fqns_per_model_part": neutral(None, _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_first_stage_less_layers": neutral(1, _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_last_stage_less_layers": neutral(1, _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_layers_per_stage": neutral(None, _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_schedule": neutral("1F1B", _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_schedule_csv": neutral("", _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_microbatch_size": neutral(1, _PP, gate=PIPELINE),
    "parallelism.pipeline_parallel_expert_parallel_overlap": neutral(True, _PP, gate=PIPELINE),
    "parallelism.context_parallel_degree": neutral(1, _CP),
    "parallelism.context_parallel_load_balancer": neutral("headtail", _CP, gate=CONTEXT),
    "parallelism.context_parallel_rotate_method": neutral("allgather", _CP, gate=CONTEXT),
    "parallelism.expert_parallel_degree": neutral(1, _EP),
    "parallelism.expert_tensor_parallel_degree": neutral(1, _EP, gate=EXPERT),
    "parallelism.expert_parallel_comm_backend": neutral("standard", _EP, gate=EXPERT),
    # [checkpoint]
    "checkpoint.enable": SUPPORTED,
    "checkpoint.enable_ft_dataloader_checkpoints": neutral(True, _FT, gate=FAULT_TOLERANCE),
    "checkpoint.folder": SUPPORTED,
    "checkpoint.interval": SUPPORTED,
    "checkpoint.initial_load_path": supported("a Hugging Face folder only (with initial_load_in_hf = true); "
                                              "used only when there is no checkpoint to resume"),
    "checkpoint.initial_load_model_only": supported("must stay true: HF weights hold no optimizer state"),
    "checkpoint.initial_load_in_hf": supported("must be true when initial_load_path is set"),
    "checkpoint.initial_load_in_hf_quantized": neutral(False, _INITIAL_LOAD, gate=INITIAL_LOAD),
    "checkpoint.last_save_model_only": alias("checkpoint.model_only_final", "weft's default is false"),
    "checkpoint.last_save_in_hf": alias(
        "checkpoint.export_hf", "weft also keeps the last checkpoint in DCP and writes the Hugging Face "
                                "safetensors under <checkpoint.folder>/hf/"),
    "checkpoint.export_dtype": SUPPORTED,
    "checkpoint.async_mode": supported("disabled, async; async_with_pinned_mem is refused"),
    "checkpoint.keep_latest_k": SUPPORTED,
    "checkpoint.load_step": SUPPORTED,
    "checkpoint.exclude_from_loading": neutral(
        [], "weft resumes every part of a checkpoint; start a fresh job.dump_folder to start over"),
    "checkpoint.enable_first_step_checkpoint": neutral(False, "weft saves every checkpoint.interval steps; set it to 1 to test saving"),
    "checkpoint.create_seed_checkpoint": neutral(
        False, "weft needs no seed checkpoint: its initialization is seeded (training.seed) and the same on every mesh"),
    "checkpoint.load_only": neutral(False, "weft saves the checkpoints of every run that has checkpoint.enable"),
    # [activation_checkpoint]
    "activation_checkpoint.mode": supported("none, selective, full, memory_budget (memory_budget needs compile)"),
    "activation_checkpoint.selective_ac_option": SUPPORTED,
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": neutral(
        ["moe.router.gate"], "weft's op-level policy saves every other matmul output and takes no module list",
        also=([],)),
    "activation_checkpoint.early_stop": neutral(False, "weft's activation checkpointing always recomputes the whole region"),
    "activation_checkpoint.memory_budget": SUPPORTED,
    "activation_checkpoint.visualize_memory_budget_pareto": inert(
        False, "weft's memory_budget mode sets the partitioner's budget and draws no Pareto plot"),
    "activation_checkpoint.preserve_rng_state": inert(True, "weft's Llama 3 has no dropout: nothing random is recomputed"),
    "activation_checkpoint.determinism_check": neutral("default", "weft uses torch.utils.checkpoint's default check"),
    "activation_checkpoint.debug": neutral(False, "weft has no activation-checkpoint debug mode"),
    # [compile]
    "compile.enable": SUPPORTED,
    "compile.components": SUPPORTED,
    "compile.backend": SUPPORTED,
    # [quantize]: only read by a converter named in model.converters
    "quantize.linear.float8.enable_fsdp_float8_all_gather": neutral(False, _CONVERT, gate=CONVERTERS),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": neutral(False, _CONVERT, gate=CONVERTERS),
    "quantize.linear.float8.recipe_name": neutral(None, _CONVERT, gate=CONVERTERS),
    "quantize.linear.float8.filter_fqns": neutral([], _CONVERT, gate=CONVERTERS),
    "quantize.linear.float8.emulate": neutral(False, _CONVERT, gate=CONVERTERS),
    "quantize.linear.mx.mxfp8_dim1_cast_kernel_choice": neutral("triton", _CONVERT, gate=CONVERTERS),
    "quantize.linear.mx.recipe_name": neutral("mxfp8_cublas", _CONVERT, gate=CONVERTERS),
    "quantize.linear.mx.filter_fqns": neutral(["output"], _CONVERT, gate=CONVERTERS),
    "quantize.grouped_mm.float8.fqns": neutral([], _CONVERT, gate=CONVERTERS),
    "quantize.grouped_mm.mx.recipe_name": neutral("mxfp8", _CONVERT, gate=CONVERTERS),
    "quantize.grouped_mm.mx.fqns": neutral([], _CONVERT, gate=CONVERTERS),
    # [comm]
    "comm.init_timeout_seconds": SUPPORTED,
    "comm.train_timeout_seconds": SUPPORTED,
    "comm.trace_buf_size": SUPPORTED,
    "comm.save_traces_folder": SUPPORTED,
    "comm.save_traces_file_prefix": SUPPORTED,
    "comm.mode": supported("default and fake_backend (the dry run); local_tensor is refused"),
    # [memory_estimation]
    "memory_estimation.enable": neutral(False, "weft has no memory estimator yet (issue 11); the metrics log measured memory"),
    "memory_estimation.disable_fake_mode": inert(False, "read only by the memory estimator, which weft does not have"),
    # [fault_tolerance]
    "fault_tolerance.enable": neutral(False, _FT),
    "fault_tolerance.process_group": neutral("gloo", _FT, gate=FAULT_TOLERANCE),
    "fault_tolerance.process_group_timeout_ms": neutral(10000, _FT, gate=FAULT_TOLERANCE),
    "fault_tolerance.replica_id": neutral(0, _FT, gate=FAULT_TOLERANCE),
    "fault_tolerance.group_size": neutral(0, _FT, gate=FAULT_TOLERANCE),
    "fault_tolerance.min_replica_size": neutral(1, _FT, gate=FAULT_TOLERANCE),
    "fault_tolerance.semi_sync_method": neutral(None, _FT, gate=FAULT_TOLERANCE),
    # [experimental]
    "experimental.custom_import": neutral("", "weft imports no user modules; model families register in models/__init__.py"),
    "experimental.custom_args_module": neutral("", "weft has no config extension modules; its keys live in trainer/config.py"),
    # [validation]
    "validation.enable": SUPPORTED,
    "validation.dataset": inert(
        "c4_validation", "weft validates on a held-out tail of the training data (a hub dataset's 'validation' "
                         "split), or on validation.dataset_path"),
    "validation.dataset_path": SUPPORTED,
    "validation.local_batch_size": neutral(8, _VAL_SHAPE, gate=VALIDATION),
    "validation.seq_len": neutral(2048, _VAL_SHAPE, gate=VALIDATION),
    "validation.freq": SUPPORTED,
    "validation.steps": supported("must be >= 1: weft has no -1 (the whole validation set)"),
    "validation.dataloader.num_workers": neutral(0, _WORKERS, gate=VALIDATION),
    "validation.dataloader.persistent_workers": neutral(False, _WORKERS, gate=VAL_WORKERS),
    "validation.dataloader.pin_memory": inert(False, "weft copies batches from pinned memory whenever it trains on CUDA"),
    "validation.dataloader.prefetch_factor": neutral(None, _WORKERS, gate=VAL_WORKERS),
    # [debug]
    "debug.seed": alias("training.seed"),
    "debug.deterministic": alias("training.deterministic"),
    "debug.deterministic_warn_only": neutral(
        False, "weft's training.deterministic makes non-deterministic ops an error; it has no warn-only mode"),
    "debug.moe_force_load_balance": inert(False, "only read for MoE models; weft's Llama 3 is dense"),
}

# torchtitan values that name torchtitan's own assets -> (weft value, the note logged once at start).
TEST_TOKENIZER_NOTE = ('model.hf_assets_path = "./tests/assets/tokenizer" is torchtitan\'s test tokenizer (a Hugging '
                       "Face tokenizer.json test vocabulary); weft uses its bundled cl100k_base tokenizer instead")
VALUE_MAP: dict[tuple[str, Any], tuple[Any, str]] = {
    ("model.hf_assets_path", "./tests/assets/tokenizer"): ("", TEST_TOKENIZER_NOTE),
    ("model.hf_assets_path", "tests/assets/tokenizer"): ("", TEST_TOKENIZER_NOTE),
    ("training.dataset", "c4_test"): (
        "stdlib", 'training.dataset = "c4_test" is torchtitan\'s bundled 2K-document test set; weft trains on its '
                  'embedded default corpus instead (training.dataset = "stdlib")'),
    ("training.dataset", "c4"): (
        "allenai/c4:en", 'training.dataset = "c4" is the Hugging Face hub dataset allenai/c4, config en '
                         '(training.dataset = "allenai/c4:en")'),
}

SECTIONS = tuple(dict.fromkeys(key.split(".", 1)[0] for key in TABLE))


def lookup(dotted: str) -> Key | None:
    """The entry of a torchtitan key that `trainer/config.py` must not handle as a weft key."""
    entry = TABLE.get(dotted)
    return None if entry is None or entry.action == SUPPORTED_ACTION else entry


def keys_of_section(section: str) -> list[str]:
    return [key for key in TABLE if key.split(".", 1)[0] == section]


def _show(value: Any) -> str:
    return json.dumps(value)


class TorchtitanKeys:
    """What one config load saw of torchtitan: neutral keys' final values and value notes.

    `finish` runs after the TOML file and the command line are applied (a command-line value
    may turn a TOML value neutral), refuses every non-neutral key in one `ConfigError`, and
    returns the lines to log once at start.
    """

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.notes: list[str] = []

    def record(self, dotted: str, value: Any) -> None:
        self.values[dotted] = value

    def translate(self, dotted: str, value: Any) -> Any:
        mapped = VALUE_MAP.get((dotted, value)) if isinstance(value, str) else None
        if mapped is None:
            return value
        new, note = mapped
        if note not in self.notes:
            self.notes.append(note)
        return new

    def _gate_off(self, gate: tuple[str, tuple] | None, weft_value: Callable[[str], Any]) -> bool:
        if gate is None:
            return False
        key, off = gate
        if key in self.values:
            value = self.values[key]
        elif lookup(key) is not None:
            return True  # absent: torchtitan's default, which keeps the feature off
        else:
            value = weft_value(key)
        return any(_same(value, v) for v in off)

    def finish(self, weft_value: Callable[[str], Any]) -> list[str]:
        ignored: list[str] = []
        refused: dict[str, list[str]] = {}
        for key, value in self.values.items():
            entry = TABLE[key]
            shown = f"{key} = {_show(value)}"
            if entry.accepts(value, self._gate_off(entry.gate, weft_value)):
                ignored.append(shown)
            else:
                refused.setdefault(entry.why, []).append(shown)
        if refused:
            reasons = " ".join(f"({n}) {', '.join(keys)}: {why}." for n, (why, keys) in enumerate(refused.items(), 1))
            raise ConfigError(
                f"torchtitan keys with values weft does not support (see {DOC}): {reasons} Remove these keys or "
                "set them to torchtitan's default."
            )
        if ignored:
            return [*self.notes, f"torchtitan keys accepted at neutral values and ignored (see {DOC}): "
                                 f"{', '.join(ignored)}"]
        return list(self.notes)
