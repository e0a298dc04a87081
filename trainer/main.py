"""Entry point: parse, check and resolve before any process-group work, then train.

Every user-facing error (`trainer/errors.py`) is printed once, by rank 0, as one line, and
ends the process with its exit code: 2 for a mistake to fix before running again, 1 for a
run that had to stop; 0 on success. This is the one place that maps errors to exit codes.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from trainer.comm import init_process_group
from trainer.config import help_text, load_config_with_notes
from trainer.data.build import check_data_sources
from trainer.dry_run import dry_run
from trainer.dump_lock import DumpFolderLock
from trainer.errors import TrainingStopped, WeftError
from trainer.run import ResolvedRun, resolve_run

LOG_LEVEL_ENV = "WEFT_LOG_LEVEL"
logger = logging.getLogger(__name__)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Formatter(logging.Formatter):
    """`[weft] 12:34:56 message`, with the level named when it is not INFO and the rank when not 0."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.tag = "[weft]" if rank == 0 else f"[weft rank{rank}]"

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created))
        level = "" if record.levelno == logging.INFO else f"{record.levelname} "
        text = f"{self.tag} {when} {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at the time of the record (test harnesses swap it)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


PROJECT_LOGGERS = ("trainer", "parallel", "models", "__main__")  # the loggers setup_logging configures


def setup_logging(rank: int, level: str = "info") -> None:
    """Rank 0 logs at `level` (env WEFT_LOG_LEVEL wins), every other rank at WARNING, so that a
    run on 512 ranks prints each message once and still shows a problem of any one rank."""
    chosen = os.environ.get(LOG_LEVEL_ENV, level).upper() if rank == 0 else "WARNING"
    handler = _StdoutHandler()
    handler.setFormatter(_Formatter(rank))
    for name in PROJECT_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(getattr(logging, chosen, logging.INFO))
        lg.propagate = False


def _report(error: WeftError) -> int:
    if _rank() == 0:
        print(f"weft: {error.label}: {error}", file=sys.stderr, flush=True)
    return error.exit_code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed(run: ResolvedRun) -> None:
    """Always run inside a process group (one rank without torchrun) so that the single-process
    path is the same code as the multi-rank one."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    init_process_group(run.device, run.cfg.comm, run.paths.comm_traces)


def _configure_determinism(run: ResolvedRun) -> None:
    if run.cfg.training.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    torch.manual_seed(run.cfg.training.seed)


def _train(run: ResolvedRun) -> None:
    from trainer.trainer import Trainer

    _configure_determinism(run)
    _init_distributed(run)
    trainer = None
    try:
        trainer = Trainer(run)
        trainer.train()
        trainer.close()
    except TrainingStopped:
        # Raised on every rank at the same step (non-finite values, recompile budget, a failed
        # save): close collectively, so an async save already in flight still completes.
        if trainer is not None:
            trainer.close()
        raise
    except BaseException:
        # Possibly raised on this rank alone: a collective in close() would hang the job
        # instead of letting it fail.
        if trainer is not None:
            trainer.close_local()
        raise
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        if _rank() == 0:
            print(help_text())
        return 0
    lock = None
    try:
        cfg, notes = load_config_with_notes(argv)
        setup_logging(_rank(), cfg.job.log_level)
        for note in notes:  # torchtitan keys ignored or translated (trainer/torchtitan_compat.py)
            logger.info(note)
        if cfg.comm.mode == "fake_backend":
            return dry_run(cfg)  # one process, no dump-folder lock: it writes nothing
        run = resolve_run(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        check_data_sources(cfg.training, cfg.validation.dataset_path if cfg.validation.enable else None)
        if _rank() == 0:
            lock = DumpFolderLock(run.paths.dump)
            lock.acquire()
        if os.environ.get("WEFT_CHECK_CONFIG_ONLY") == "1":
            return 0
        _train(run)
        return 0
    except WeftError as e:
        return _report(e)
    finally:
        if lock is not None:
            lock.release()
