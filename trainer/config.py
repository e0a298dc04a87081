"""Typed training configuration: defaults < TOML file < command line.

Section and key names follow torchtitan wherever a feature is shared, so a torchtitan
TOML loads here unchanged for those keys. Every mistake (unknown key, wrong type, bad
TOML, missing file) raises `ConfigError` with one message that names the key and the
fix; `train.py` prints it once and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from parallel.activation_checkpoint import AC_MODES, OP_SAC_MATMULS, parse_per_block
from parallel.compile import STRATEGIES
from parallel.data_parallel import ENGINES
from parallel.fsdp import RESHARD_POLICIES
from parallel.loss import HEAD_LOSS_MODES
from trainer import torchtitan_compat
from trainer.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


@dataclass
class Job:
    config_file: str = ""  # TOML file to load before command-line overrides
    dump_folder: str = "./outputs"  # root folder for logs, TensorBoard, checkpoints
    description: str = "weft training run"  # free text, printed at start
    log_level: str = "info"  # console log level of rank 0 (debug | info | warning); env WEFT_LOG_LEVEL wins


@dataclass
class Model:
    name: str = "llama3"  # model family (registered in models/__init__.py)
    flavor: str = "debugmodel"  # size preset of the family
    tokenizer_path: str = ""  # tiktoken BPE file (or a folder, read like hf_assets_path); empty = see hf_assets_path
    hf_assets_path: str = ""  # folder holding tokenizer.model or original/tokenizer.model; both empty = bundled cl100k_base
    vocab_size: int = 0  # 0 = tokenizer size padded for TP; larger value pads further


@dataclass
class Optimizer:
    name: str = "AdamW"  # only AdamW is supported
    lr: float = 8e-4  # peak learning rate
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay
    implementation: str = "auto"  # auto (triton on CUDA where installed, else fused; foreach on CPU) | fused | foreach | for-loop | triton (GPU: one Triton kernel per parameter; reads compact gradients as held)
    overlap_step: str = "auto"  # step each unit on a side stream during the next forward (dp = 1); auto = on where it applies on a GPU | on | off


@dataclass
class LRScheduler:
    warmup_steps: int = 200  # linear warmup steps
    decay_ratio: Optional[float] = None  # fraction of steps spent decaying; unset = decay after warmup
    decay_type: str = "linear"  # linear | cosine | constant
    min_lr_factor: float = 0.0  # final lr as a fraction of the peak


@dataclass
class Training:
    local_batch_size: int = 8  # sequences per micro-batch on each data-parallel rank
    global_batch_size: int = -1  # sequences per step over all ranks; -1 = local_batch_size * dp
    seq_len: int = 2048  # tokens per sequence
    max_norm: float = 1.0  # gradient clipping norm (0 = off)
    steps: int = 10000  # optimizer steps to train
    dataset: str = "stdlib"  # stdlib (embedded default) | a local path | a hub dataset name
    dataset_path: str = ""  # local folder or glob of .txt/.jsonl/.json/.parquet or .bin/.npy tokens; overrides dataset
    dataset_mixture: list = field(default_factory=list)  # SOURCE:WEIGHT items mixed by token share; overrides dataset_path
    dataset_streaming: bool = False  # stream documents through datasets (tokenized on the fly), no token store
    dataset_num_proc: int = 0  # processes tokenizing a text corpus into the token store; 0 = all CPUs
    seed: int = 0  # seed for init, data order and dropout-free RNG use
    deterministic: bool = False  # use deterministic algorithms (slower)
    mixed_precision_param: str = "auto"  # auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16
    mixed_precision_reduce: str = "float32"  # gradient reduce dtype
    compact_gradients: bool = False  # one GPU (dp = tp = 1), bf16 compute, one micro-batch: gradients stay bf16 until the step widens them (FSDP2's numerics; 2 bytes/param less at the end of backward)
    compute_weight_copies: bool = False  # with compact_gradients: keep each cast-at-use weight's bf16 copy (written by the Triton AdamW's step) for forward to read instead of casting; 2 bytes/param more, about what no-AC forward keeps of the casts anyway
    head_loss: str = "separate"  # separate (head, then loss on its logits) | fused (loss inside the head, chunk by chunk: no [tokens, vocab] logits; tp = 1)
    gc_freq: int = 50  # run Python GC every N steps (automatic GC is disabled)
    device: str = "auto"  # auto | cuda | cpu


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1  # HSDP replicas (outermost mesh dim, e.g. nodes); gradients all-reduced across them
    data_parallel_shard_degree: int = -1  # FSDP degree; -1 = world size / (replicate x tensor_parallel_degree)
    tensor_parallel_degree: int = 1  # TP degree (innermost mesh dim)
    enable_sequence_parallel: bool = True  # shard norms/residual on the sequence dim when tp > 1
    enable_loss_parallel: bool = True  # vocab-sharded logits and cross-entropy when tp > 1
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    gradient_sync: str = "step"  # with accumulation: step (reduce once per step) | microbatch (reduce-scatter each)
    data_parallel_engine: str = "auto"  # auto (graph with compile.strategy=model, else fully_shard) | fully_shard | graph


@dataclass
class Compile:
    enable: bool = False  # torch.compile the model (and loss)
    strategy: str = "blocks"  # blocks (each transformer block) | model (whole model)
    backend: str = "inductor"  # torch.compile backend
    components: list = field(default_factory=lambda: ["model", "loss"])  # what to compile
    recompile_limit: int = 8  # torch._dynamo.config.recompile_limit
    warmup_steps: int = 2  # steps after which recompiles count against the budget
    max_recompiles_after_warmup: Optional[int] = None  # stop the run past this many recompiles
    fail_on_recompile: bool = False  # error on any recompile after warm-up


@dataclass
class ActivationCheckpoint:
    mode: str = "selective"  # none | full | selective | memory_budget (compiled blocks only)
    selective_ac_option: str = "op"  # op (op-level policy) or an integer N (every N-th block)
    op_sac_matmuls: str = "alternate"  # op SAC saves: alternate (every other matmul output, as torchtitan) | all (every one: no matmul recompute, more memory)
    memory_budget: float = 0.5  # memory_budget mode: activations kept, as a fraction of no AC's, in (0, 1]
    per_block: str = ""  # per_block mode: kind:count,... from the first block on; kinds full, op, op_all (op SAC saving every matmul), none; e.g. "op:18,full:10"
    offload_blocks: int = 0  # hold the saved activations of the first N blocks in host memory from forward to backward (compiled per block, or eager blocks without AC)


@dataclass
class Checkpoint:
    enable: bool = False  # save and resume checkpoints
    folder: str = "checkpoint"  # relative: under dump_folder (no '..'); absolute: anywhere
    interval: int = 500  # save every N steps
    keep_latest_k: int = 10  # keep the newest k complete checkpoints (0 = all)
    load_step: int = -1  # -1 = latest complete checkpoint
    async_mode: str = "disabled"  # disabled | async
    model_only_final: bool = False  # last checkpoint holds model weights only
    export_dtype: str = "float32"  # dtype of the exported final model
    save_on_sigusr1: bool = False  # treat SIGUSR1 like SIGTERM: finish the step, save, exit 0
    preemption_check_freq: int = 5  # ranks agree on a preemption signal every N steps (a CPU all-reduce, no device sync)
    export_hf: bool = False  # at the end, write <folder>/hf/: HF Llama safetensors (+ index) and config.json
    initial_load_path: str = ""  # with no checkpoint to resume, start from this Hugging Face model folder
    initial_load_in_hf: bool = False  # initial_load_path holds Hugging Face safetensors (must be true to use it)
    initial_load_model_only: bool = True  # initial load sets the model only (must stay true for HF weights)
    verify: bool = True  # on resume, check every file against the checkpoint's manifest (size + crc32)
    allow_data_change: bool = False  # resume on data whose fingerprint differs from the checkpoint's


@dataclass
class Metrics:
    log_freq: int = 10  # log every N steps
    enable_tensorboard: bool = True  # write TensorBoard events
    save_tb_folder: str = "tb"  # relative: under dump_folder (no '..'); absolute: anywhere
    enable_jsonl: bool = True  # write metrics.jsonl under dump_folder


@dataclass
class Validation:
    enable: bool = False  # run a held-out loss every freq steps
    freq: int = 100  # validate every N steps
    steps: int = 10  # batches per validation
    dataset_path: str = ""  # held-out data; empty = a split of the training data


@dataclass
class Profiling:
    enable_profiling: bool = False  # torch.profiler traces
    profile_freq: int = 100  # trace one step every N steps
    save_traces_folder: str = "profile_traces"  # relative: under dump_folder (no '..'); absolute: anywhere
    enable_memory_snapshot: bool = False  # CUDA memory snapshot
    save_memory_snapshot_folder: str = "memory_snapshot"  # relative: under dump_folder (no '..'); absolute: anywhere


@dataclass
class Comm:
    init_timeout_seconds: int = 300  # collective timeout from process-group start until the first step ends (compile is slow)
    train_timeout_seconds: int = 100  # collective timeout after the first step
    trace_buf_size: int = 20000  # NCCL flight recorder: collectives kept per rank, dumped on a timeout (0 = off)
    save_traces_folder: str = "comm_traces"  # flight-recorder dumps; relative: under dump_folder (no '..'); absolute: anywhere
    save_traces_file_prefix: str = "rank_"  # dump file name = prefix + rank
    mode: str = "default"  # default (train) | fake_backend (dry run: plan + memory/time estimate in one CPU process, then exit)
    fake_world_size: int = 0  # ranks a fake_backend dry run simulates; 0 = the NGPU environment variable
    dry_run_mfu: float = 0.4  # model-FLOPs utilization the dry run's time estimate assumes (a measured mfu / 100 fits best)
    dry_run_peak_tflops: float = 989.0  # dense bf16 TFLOP/s per GPU for the time estimate (989 = H100/H200 SXM)
    dry_run_gpu_memory_gib: float = 80.0  # GPU memory the dry run checks the peak against (0 = no check)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The choices of keys that parallel/ implements are declared there, next to the code.
CHOICES: dict[str, tuple[str, ...]] = {
    "job.log_level": ("debug", "info", "warning"),
    "optimizer.name": ("AdamW",),
    "optimizer.implementation": ("auto", "fused", "foreach", "for-loop", "triton"),
    "optimizer.overlap_step": ("auto", "on", "off"),
    "lr_scheduler.decay_type": ("linear", "cosine", "constant"),
    "training.mixed_precision_param": ("auto", "float32", "bfloat16"),  # fp16 would need loss scaling
    "training.mixed_precision_reduce": ("float32", "bfloat16"),
    "training.head_loss": HEAD_LOSS_MODES,
    "training.device": ("auto", "cuda", "cpu"),
    "parallelism.fsdp_reshard_after_forward": RESHARD_POLICIES,
    "parallelism.gradient_sync": ("step", "microbatch"),
    "parallelism.data_parallel_engine": ENGINES,
    "compile.strategy": STRATEGIES,
    "activation_checkpoint.mode": AC_MODES,
    "activation_checkpoint.op_sac_matmuls": OP_SAC_MATMULS,
    "checkpoint.async_mode": ("disabled", "async"),
    "checkpoint.export_dtype": ("float32", "bfloat16", "float16"),
    "comm.mode": ("default", "fake_backend", "local_tensor"),  # local_tensor is refused (torchtitan's, not weft's)
}


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _key_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    base, optional = _unwrap_optional(tp)
    name = "list" if base is list or typing.get_origin(base) is list else base.__name__
    return f"{name} (optional)" if optional else name


_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert a TOML value or command-line string to the declared type, or explain why not."""
    base, optional = _unwrap_optional(tp)
    if optional and (value is None or (from_cli and str(value).lower() in ("none", "null", ""))):
        return None
    bad = ConfigError(
        f"config key '{key}' expects {_type_name(tp)}, got {value!r}. "
        f"Fix it in the TOML file or pass e.g. --{key} {_example(base)}."
    )
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise bad
    if base in (int, float):
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int) or (base is float and isinstance(value, float)):
            return base(value)
        if from_cli:
            try:
                return base(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if base is list or typing.get_origin(base) is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        raise bad
    raise bad


def _example(base: Any) -> str:
    return {bool: "true", int: "4", float: "0.5", str: "VALUE"}.get(base, "a,b")


class _Load:
    """State of one `load_config`: where values come from now, and what torchtitan keys did."""

    def __init__(self) -> None:
        self.source = "the command line"
        self.torchtitan = torchtitan_compat.TorchtitanKeys()
        self._claims: dict[tuple[str, str], tuple[str, Any]] = {}

    def claim(self, weft_key: str, given_as: str, value: Any) -> None:
        """Refuse one source setting one weft key twice, differently (`debug.seed` and `training.seed`)."""
        previous = self._claims.get((self.source, weft_key))
        if previous is not None and previous[0] != given_as and previous[1] != value:
            raise ConfigError(
                f"{self.source} sets '{previous[0]}' = {previous[1]!r} and '{given_as}' = {value!r}, which are the "
                "same setting in weft; keep one of them."
            )
        self._claims[(self.source, weft_key)] = (given_as, value)


def _set(cfg: JobConfig, dotted: str, raw: Any, from_cli: bool, load: _Load, given_as: str = "") -> None:
    section_name, _, key = dotted.partition(".")
    torchtitan_key = None if _is_weft_key(dotted) else torchtitan_compat.lookup(dotted)
    if torchtitan_key is not None:
        _set_torchtitan(cfg, dotted, torchtitan_key, raw, from_cli, load)
        return
    sections = [f.name for f in dataclasses.fields(JobConfig)]
    if section_name not in sections:
        if section_name in torchtitan_compat.SECTIONS:
            _unknown_key(dotted, torchtitan_compat.keys_of_section(section_name))
        known = sections + [s for s in torchtitan_compat.SECTIONS if s not in sections]
        raise ConfigError(
            f"unknown config section '{section_name}' (in '{dotted}')."
            f"{_suggest(section_name, known)} Run with --help to list every key."
        )
    section = getattr(cfg, section_name)
    types_ = _key_types(type(section))
    if key not in types_:
        _unknown_key(dotted, [f"{section_name}.{k}" for k in types_] + torchtitan_compat.keys_of_section(section_name))
    value = load.torchtitan.translate(dotted, _coerce(given_as or dotted, raw, types_[key], from_cli))
    allowed = CHOICES.get(dotted)
    if allowed is not None and value not in allowed:
        raise ConfigError(
            f"config key '{dotted}' must be one of {', '.join(allowed)}; got {value!r}."
            f"{_suggest(str(value), list(allowed))}"
        )
    load.claim(dotted, given_as or dotted, value)
    setattr(section, key, value)


def _unknown_key(dotted: str, known: list[str]) -> None:
    raise ConfigError(f"unknown config key '{dotted}'.{_suggest(dotted, known)} Run with --help to list every key.")


def _set_torchtitan(cfg: JobConfig, dotted: str, entry: torchtitan_compat.Key, raw: Any, from_cli: bool,
                    load: _Load) -> None:
    """A torchtitan key weft has under another name (set that), or lacks (note its value for the end)."""
    if entry.action == torchtitan_compat.ALIAS_ACTION:
        if entry.invert:
            _set(cfg, entry.target, not _coerce(dotted, raw, bool, from_cli), False, load, given_as=dotted)
        else:
            _set(cfg, entry.target, raw, from_cli, load, given_as=dotted)
        return
    value = raw if entry.default is None else _coerce(dotted, raw, type(entry.default), from_cli)
    load.torchtitan.record(dotted, value)


def _load_toml(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file '{path}' not found (from --job.config_file). "
            "Pass an existing TOML file, e.g. train_configs/debug_model.toml."
        )
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}. Fix the line shown.") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], path: str, load: _Load) -> None:
    load.source = f"config file '{path}'"
    for section_name, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"'{section_name}' in '{path}' must be a [section] table, e.g. [training] then steps = 10."
            )
        for dotted, value in _flatten(section_name, table):
            _set(cfg, dotted, value, from_cli=False, load=load)
    load.source = "the command line"


def _flatten(prefix: str, table: dict[str, Any]) -> list[tuple[str, Any]]:
    """Nested tables ([training.dataloader], [quantize.linear.float8]) as dotted keys."""
    out: list[tuple[str, Any]] = []
    for key, value in table.items():
        dotted = f"{prefix}.{key}"
        out += _flatten(dotted, value) if isinstance(value, dict) else [(dotted, value)]
    return out


def _parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    """Turn ['--a.b', 'v', '--c.d=w', '--e.flag', '--e.no-flag'] into (key, raw) pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument '{arg}'. Overrides look like --section.key value; run with --help."
            )
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            pairs.append((key, raw))
            i += 1
            continue
        key = body
        section, _, name = key.partition(".")
        is_bool = _is_bool_key(key)
        negated = None
        for prefix in ("no-", "no_"):
            if name.startswith(prefix) and _is_bool_key(f"{section}.{name[len(prefix):]}"):
                negated = f"{section}.{name[len(prefix):]}"
        if negated is not None and not is_bool:
            pairs.append((negated, "false"))
            i += 1
            continue
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if is_bool and (nxt is None or nxt.lower() not in _TRUE + _FALSE):
            pairs.append((key, "true"))
            i += 1
            continue
        if nxt is None or (nxt.startswith("--") and "." in nxt):
            raise ConfigError(f"missing value for --{key}. Pass it as --{key} VALUE or --{key}=VALUE.")
        pairs.append((key, nxt))
        i += 2
    return pairs


def _weft_type(dotted: str) -> Any:
    """The declared type of a weft key, or None when weft has no such key."""
    section_name, _, key = dotted.partition(".")
    section_cls = _key_types(JobConfig).get(section_name)
    return None if section_cls is None else _key_types(section_cls).get(key)


def _is_weft_key(dotted: str) -> bool:
    """Weft's own keys win over the torchtitan table, so a key weft gains is never shadowed by it."""
    return _weft_type(dotted) is not None


def _is_bool_key(dotted: str) -> bool:
    tp = _weft_type(dotted)
    if tp is not None:
        return _unwrap_optional(tp)[0] is bool
    entry = torchtitan_compat.lookup(dotted)
    if entry is None:
        return False
    return entry.invert or isinstance(entry.default, bool) or (bool(entry.target) and _is_bool_key(entry.target))


def load_config(argv: list[str]) -> JobConfig:
    """Build the config from defaults, then `--job.config_file`, then the other overrides."""
    return load_config_with_notes(argv)[0]


def load_config_with_notes(argv: list[str]) -> tuple[JobConfig, list[str]]:
    """`load_config`, plus the lines to log once at start about torchtitan keys and values
    (ignored keys, translated values); see trainer/torchtitan_compat.py."""
    pairs = _parse_cli(argv)
    cfg = JobConfig()
    load = _Load()
    config_files = [raw for key, raw in pairs if key == "job.config_file"]
    if config_files:
        path = config_files[-1]
        _apply_toml(cfg, _load_toml(path), path, load)
    for key, raw in pairs:
        _set(cfg, key, raw, from_cli=True, load=load)
    notes = load.torchtitan.finish(lambda dotted: _value_of(cfg, dotted))
    _check_values(cfg)
    return cfg, notes


def _value_of(cfg: JobConfig, dotted: str) -> Any:
    section, _, key = dotted.partition(".")
    return getattr(getattr(cfg, section), key)


def _check_values(cfg: JobConfig) -> None:
    """Range checks that need no process group; mesh checks live in parallel/mesh.py."""
    t = cfg.training
    positive = {
        "training.local_batch_size": t.local_batch_size,
        "training.seq_len": t.seq_len,
        "training.steps": t.steps,
        "metrics.log_freq": cfg.metrics.log_freq,
        "checkpoint.interval": cfg.checkpoint.interval,
        "validation.freq": cfg.validation.freq,
        "validation.steps": cfg.validation.steps,
        "profiling.profile_freq": cfg.profiling.profile_freq,
        "training.gc_freq": t.gc_freq,
        "compile.recompile_limit": cfg.compile.recompile_limit,
        "parallelism.tensor_parallel_degree": cfg.parallelism.tensor_parallel_degree,
        "checkpoint.preemption_check_freq": cfg.checkpoint.preemption_check_freq,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1, got {value}.")
    if t.global_batch_size != -1 and t.global_batch_size < 1:
        raise ConfigError(f"training.global_batch_size must be -1 (auto) or >= 1, got {t.global_batch_size}.")
    if t.dataset_num_proc < 0:
        raise ConfigError(f"training.dataset_num_proc must be >= 0 (0 = all CPUs), got {t.dataset_num_proc}.")
    dp = cfg.parallelism.data_parallel_shard_degree
    if dp != -1 and dp < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree must be -1 (auto) or >= 1, got {dp}.")
    o = cfg.optimizer
    for key, value in (("optimizer.lr", o.lr), ("optimizer.eps", o.eps), ("optimizer.weight_decay", o.weight_decay)):
        if not (math.isfinite(value) and 0 <= value <= _FLOAT32_MAX):
            raise ConfigError(
                f"config key '{key}' must be a finite number in [0, {_FLOAT32_MAX:.3g}] (the float32 range "
                f"the optimizer computes in); got {value}."
            )
    max_norm = t.max_norm
    if not (math.isfinite(max_norm) and max_norm >= 0):
        raise ConfigError(f"training.max_norm must be >= 0 (0 turns clipping off) and finite; got {max_norm}.")
    if not (0.0 <= o.beta1 < 1.0 and 0.0 <= o.beta2 < 1.0):
        raise ConfigError(f"optimizer.beta1 and optimizer.beta2 must be in [0, 1); got {o.beta1}, {o.beta2}.")
    if cfg.compile.warmup_steps < 0:
        raise ConfigError("compile.warmup_steps must be >= 0.")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError("lr_scheduler.warmup_steps must be >= 0.")
    ratio = cfg.lr_scheduler.decay_ratio
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in [0, 1], got {ratio}.")
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError("lr_scheduler.min_lr_factor must be in [0, 1].")
    option = cfg.activation_checkpoint.selective_ac_option
    if option != "op" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError(
            f"activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got {option!r}."
        )
    ac = cfg.activation_checkpoint
    if ac.mode == "per_block" and not ac.per_block:
        raise ConfigError("activation_checkpoint.mode = 'per_block' needs activation_checkpoint.per_block, e.g. "
                          "'op:18,full:10' (the dry run with comm.dry_run_gpu_memory_gib suggests one that fits).")
    if ac.per_block:
        try:
            kinds = set(parse_per_block(ac.per_block))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # Per-block compile traces one graph per kind of block (the first of each recompiles the
        # shared block code); past the limit, the later kinds would silently run eager.
        per_block_compiled = ac.mode == "per_block" and cfg.compile.enable and cfg.compile.strategy == "blocks"
        if per_block_compiled and len(kinds) > cfg.compile.recompile_limit:
            raise ConfigError(f"activation_checkpoint.per_block = {ac.per_block!r} compiles {len(kinds)} block graphs, "
                              f"more than compile.recompile_limit = {cfg.compile.recompile_limit}; raise the limit.")
    if not 0.0 < ac.memory_budget <= 1.0:
        raise ConfigError(f"activation_checkpoint.memory_budget must be in (0, 1], got {ac.memory_budget}.")
    if ac.mode == "memory_budget" and not (cfg.compile.enable and "model" in cfg.compile.components):
        raise ConfigError(
            "activation_checkpoint.mode = 'memory_budget' is carried out by the compiler: "
            "also pass --compile.enable (with 'model' in compile.components), or pick another mode."
        )
    _check_comm(cfg.comm)
    unknown = set(cfg.compile.components) - {"model", "loss"}
    if unknown:
        raise ConfigError(f"compile.components accepts model and loss; got {sorted(unknown)}.")
    if cfg.compile.enable:
        _check_compile_backend(cfg.compile.backend)


def _check_comm(c: Comm) -> None:
    if c.mode == "local_tensor":
        raise ConfigError(
            "comm.mode 'local_tensor' (torchtitan's one-process simulation of every rank's compute) is not "
            "supported by weft; use comm.mode = 'fake_backend' for a dry run, or 'default' to train."
        )
    for key, value in (("comm.init_timeout_seconds", c.init_timeout_seconds),
                       ("comm.train_timeout_seconds", c.train_timeout_seconds)):
        if value < 1:
            raise ConfigError(f"config key '{key}' must be >= 1 second, got {value}.")
    for key, value in (("comm.trace_buf_size", c.trace_buf_size), ("comm.fake_world_size", c.fake_world_size)):
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}.")
    if not 0.0 < c.dry_run_mfu <= 1.0:
        raise ConfigError(f"comm.dry_run_mfu is a fraction in (0, 1] (e.g. 0.4 for 40% MFU), got {c.dry_run_mfu}.")
    if not (math.isfinite(c.dry_run_peak_tflops) and c.dry_run_peak_tflops > 0):
        raise ConfigError(f"comm.dry_run_peak_tflops must be > 0, got {c.dry_run_peak_tflops}.")
    if not (math.isfinite(c.dry_run_gpu_memory_gib) and c.dry_run_gpu_memory_gib >= 0):
        raise ConfigError(f"comm.dry_run_gpu_memory_gib must be >= 0 (0 = no check), got {c.dry_run_gpu_memory_gib}.")
    prefix = c.save_traces_file_prefix
    if not prefix or os.sep in prefix or prefix in (".", ".."):
        raise ConfigError(
            f"comm.save_traces_file_prefix {prefix!r} must be a plain file-name prefix (no '{os.sep}'), e.g. 'rank_'; "
            "put folders in comm.save_traces_folder."
        )


def _check_compile_backend(backend: str) -> None:
    import torch._dynamo  # imported here: it takes a second and only compiled runs need it

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ConfigError(
            f"compile.backend '{backend}' is not a torch.compile backend.{_suggest(backend, known)} "
            f"Use inductor (default), aot_eager or eager."
        )


def to_toml(cfg: JobConfig) -> str:
    """Serialize so that `load_config(['--job.config_file', path])` gives back the same config."""
    lines: list[str] = []
    for section_name, table in cfg.to_dict().items():
        lines.append(f"[{section_name}]")
        for key, value in table.items():
            if value is None:
                continue  # TOML has no null; the default of every optional key is None
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # JSON string escapes are valid TOML basic-string escapes


def help_text() -> str:
    """Every key with its type, default and the comment that documents it."""
    import inspect

    out = ["usage: train.py --job.config_file FILE [--section.key VALUE ...]", ""]
    for f in dataclasses.fields(JobConfig):
        section_cls = _key_types(JobConfig)[f.name]
        comments = _field_comments(inspect.getsource(section_cls))
        out.append(f"[{f.name}]")
        defaults = dataclasses.asdict(section_cls())
        for key, tp in _key_types(section_cls).items():
            flag = f"--{f.name}.{key}"
            out.append(f"  {flag:<48} {_type_name(tp):<16} default={defaults[key]!r:<14} {comments.get(key, '')}")
        out.append("")
    return "\n".join(out)


def _field_comments(source: str) -> dict[str, str]:
    comments = {}
    for line in source.splitlines():
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith("#"):
            comments[stripped.split(":", 1)[0].strip()] = stripped.split("#", 1)[1].strip()
    return comments
