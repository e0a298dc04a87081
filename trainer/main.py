"""Entry point: parse and check the config before any process-group work, then train.

Every user mistake found here is printed once (rank 0) as one line, and the process exits
with code 2; a non-finite loss exits with 1; success with 0.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

from models import MODEL_NAMES, get_model_spec
from models.llama3.args import padded_vocab_size
from parallel.mesh import ParallelConfigError, ParallelDims
from trainer.config import ConfigError, JobConfig, help_text, load_config, to_toml
from trainer.tokenizer import build_tokenizer

EXIT_CONFIG_ERROR = 2


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _print0(msg: str, *, err: bool = False) -> None:
    if _rank() == 0:
        print(msg, file=sys.stderr if err else sys.stdout, flush=True)


def prepare(cfg: JobConfig, world_size: int):
    """Everything that can be checked without a process group; returns (tokenizer, model args, dims)."""
    if cfg.model.name not in MODEL_NAMES:
        raise ConfigError(f"model.name '{cfg.model.name}' is unknown; available: {', '.join(MODEL_NAMES)}.")
    spec = get_model_spec(cfg.model.name)
    if cfg.model.flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor '{cfg.model.flavor}' is unknown for {cfg.model.name}; available: {', '.join(spec.flavors)}."
        )
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    try:
        vocab_size = padded_vocab_size(tokenizer.n_words, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(f"{e}; raise model.vocab_size or set it to 0 (automatic).") from None
    t, p = cfg.training, cfg.parallelism
    model_args = spec.build_args(cfg.model.flavor, vocab_size=vocab_size, max_seq_len=t.seq_len)
    dims = ParallelDims.resolve(world_size, p.data_parallel_shard_degree, p.tensor_parallel_degree)
    if dims.tp > 1:
        dims.check_divisible(spec.tp_divisible_sizes(model_args))
        if p.enable_sequence_parallel and t.seq_len % dims.tp:
            raise ParallelConfigError(
                f"training.seq_len={t.seq_len} is not divisible by parallelism.tensor_parallel_degree={dims.tp} "
                "with sequence parallel on; use a multiple of the TP degree or --parallelism.no-enable_sequence_parallel."
            )
    global_batch = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dims.dp
    if global_batch % (t.local_batch_size * dims.dp):
        raise ConfigError(
            f"training.global_batch_size={global_batch} must be a multiple of training.local_batch_size "
            f"({t.local_batch_size}) x data-parallel degree ({dims.dp}) = {t.local_batch_size * dims.dp}."
        )
    return tokenizer, model_args, dims


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pick_device(cfg: JobConfig) -> torch.device:
    choice = cfg.training.device
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no GPU is visible; use --training.device cpu or auto.")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _init_distributed(device: torch.device) -> None:
    """Always run inside a process group (one rank without torchrun) so that the single-process
    path is the same code as the multi-rank one: a 1x1 mesh, FSDP over one rank."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def _configure_determinism(cfg: JobConfig) -> None:
    if cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(cfg.training.seed)


def main(argv: list[str]) -> int:
    from trainer.checkpoint import CheckpointWriteError, NonFiniteStateError
    from trainer.compile_health import RecompileBudgetExceeded
    from trainer.trainer import NonFiniteLossError, Trainer

    if any(a in ("-h", "--help") for a in argv):
        _print0(help_text())
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = load_config(argv)
        tokenizer, model_args, dims = prepare(cfg, world_size)
        device = _pick_device(cfg)
    except (ConfigError, ParallelConfigError) as e:
        _print0(f"weft: config error: {e}", err=True)
        return EXIT_CONFIG_ERROR
    if os.environ.get("WEFT_CHECK_CONFIG_ONLY") == "1":
        return 0

    _print0(f"[weft] {cfg.job.description}\n[weft] resolved config:\n{to_toml(cfg)}")
    if _rank() == 0:
        os.makedirs(cfg.job.dump_folder, exist_ok=True)
        with open(os.path.join(cfg.job.dump_folder, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    _configure_determinism(cfg)
    _init_distributed(device)
    trainer = None
    try:
        trainer = Trainer(cfg, tokenizer=tokenizer, model_args=model_args, dims=dims, device=device)
        trainer.train()
        return 0
    except ConfigError as e:
        _print0(f"weft: config error: {e}", err=True)
        return EXIT_CONFIG_ERROR
    except (NonFiniteLossError, NonFiniteStateError, CheckpointWriteError, RecompileBudgetExceeded) as e:
        _print0(f"weft: {e}", err=True)
        return 1
    except BaseException:
        # Possibly raised on this rank alone: a collective in close() would hang the job
        # instead of letting it fail.
        if trainer is not None:
            trainer.close_local()
            trainer = None
        raise
    finally:
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group()
