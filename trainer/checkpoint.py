"""Distributed checkpoints: atomic, optionally async, reshardable across meshes.

Model and optimizer go through torch.distributed.checkpoint (DCP) as sharded
DTensor state dicts, so a checkpoint written by an FSDP2 x TP mesh loads on any
other mesh. Everything else is small and saved as plain files next to the DCP data.

Layout under `<dump_folder>/<checkpoint.folder>/`:

    step-<N>/                 a complete checkpoint
        .metadata, *.distcp   DCP: model (+ optimizer) shards
        trainer_state.pt      rank 0: step, lr scheduler, data loader, extra state
        rng-rank<r>.pt        each rank: torch CPU (+ CUDA) RNG state
        config.toml           resolved config of the run that saved it
        fingerprint.json      param name -> global shape, plus the model args
    step-<N>.tmp/             being written, or left by a crashed save
    step-<N>.old/             being deleted

A checkpoint is written into `step-<N>.tmp/` and renamed to `step-<N>/` by rank 0
only once every rank's data and DCP's `.metadata` are on disk: the rename is the
completion marker, so a crash at any point leaves the previous checkpoints intact
and `load()` never sees a partial one. Leftover `.tmp`/`.old` folders are ignored
and removed by the next successful save.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

# Test-only: seconds rank 0 sleeps after all data of a save is on disk and before the
# rename that marks it complete, so a test can SIGKILL the process mid-save.
HOLD_ENV = "WEFT_TEST_CHECKPOINT_HOLD_S"

TRAINER_STATE = "trainer_state.pt"
FINGERPRINT = "fingerprint.json"
CONFIG_TOML = "config.toml"

_COMPLETE = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^step-\d+\.(tmp|old)$")


def step_dir(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step}")


def complete_steps(folder: str) -> list[int]:
    """Steps of the complete checkpoints in `folder`, oldest first."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _COMPLETE.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def read_trainer_state(path: str) -> dict:
    """The small trainer state of checkpoint folder `path` (step, schedule, data position)."""
    file = os.path.join(path, TRAINER_STATE)
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict) or "step" not in state:
            raise ValueError("not a trainer state dict")
        return state
    except Exception as e:
        raise CheckpointError(
            f"checkpoint file {file} is missing or corrupt ({type(e).__name__}: {e}). "
            "Set checkpoint.load_step to another complete step, or move that folder away."
        ) from e


def param_shapes(state_dict: dict[str, Any]) -> dict[str, list[int]]:
    """Global shape of every tensor (DTensors report their global shape)."""
    return {k: list(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: str) -> None:
    """Write text/bytes as is, anything else with torch.save; fsync so the rename never publishes a torn file."""
    with open(path, "wb") as f:
        if isinstance(obj, (bytes, str)):
            f.write(obj.encode() if isinstance(obj, str) else obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _root_cause(e: BaseException) -> str:
    """One line naming the first rank's error inside DCP's CheckpointException."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, failure = next(iter(e.failures.items()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {_root_cause(inner)}"
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@dataclass
class _Pending:
    """A save whose data may still be in flight; it becomes complete in `_finish_pending`."""

    step: int
    tmp: str
    final: str
    future: Optional[Future]  # None for a synchronous save
    started: float


class CheckpointManager:
    """Saves and restores model, optimizer, LR scheduler, data loader, RNG and extra state.

    Every public method is collective except `maybe_save` on steps that do not save:
    call them on all ranks in the same order.
    """

    def __init__(
        self,
        ckpt_cfg: Any,
        *,
        dump_folder: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        dataloader: Any,
        extra_state: Callable[[], dict] | None = None,
        config_toml: str = "",
        model_fingerprint: dict | None = None,
    ) -> None:
        """`model_fingerprint` holds the model args (dim, n_layers, n_heads, n_kv_heads,
        vocab_size, norm_eps, rope_theta, max_seq_len, ...; JSON-serializable). They are
        stored with each checkpoint for export; param shapes are always taken from the
        model itself and are what `load()` checks. `extra_state()` is saved from rank 0
        and comes back as `restored_extra_state` after `load()`."""
        if ckpt_cfg.keep_latest_k < 0:
            raise ConfigError(
                f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {ckpt_cfg.keep_latest_k}."
            )
        self.cfg = ckpt_cfg
        self.enable = ckpt_cfg.enable
        self.folder = os.path.join(dump_folder, ckpt_cfg.folder)
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dataloader = dataloader
        self.extra_state = extra_state
        self.config_toml = config_toml
        self.model_args = model_fingerprint
        self.restored_extra_state: dict = {}
        self.export_dtype: torch.dtype = getattr(torch, ckpt_cfg.export_dtype)
        self.is_async = ckpt_cfg.async_mode == "async"

        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        # DCP's collectives and ours run on a dedicated gloo group: an async save runs
        # them from a background thread, and they must not interleave with training
        # collectives on the default group. Gloo works for CPU and GPU runs alike since
        # DCP only exchanges small pickled plans, never tensor data.
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self._pending: _Pending | None = None

    # ---------------------------------------------------------------- save

    def wants_save(self, step: int, *, last: bool = False) -> bool:
        """Whether `maybe_save(step, last=last)` would write a checkpoint."""
        return self.enable and (last or step % self.cfg.interval == 0)

    def maybe_save(self, step: int, *, last: bool = False) -> None:
        """Save every `interval` steps and at the last step (which also waits for the write)."""
        if not self.enable:
            return
        if self._pending is not None and self._pending.future is not None and self._pending.future.done():
            self._finish_pending()
        if last:
            self._save(step, model_only=self.cfg.model_only_final)
            self.wait()
        elif step % self.cfg.interval == 0:
            self._save(step, model_only=False)

    def save(self, step: int) -> None:
        """Full checkpoint of `step` (synchronous, or staged and written in the background)."""
        self._save(step, model_only=False)

    def wait(self) -> None:
        """Block until an in-flight async save is complete (renamed) on disk. Collective."""
        self._finish_pending()
        self._barrier()

    def close(self) -> None:
        self.wait()

    def _save(self, step: int, *, model_only: bool) -> None:
        self._finish_pending()  # never two saves at once
        started = time.monotonic()
        final = step_dir(self.folder, step)
        tmp = final + ".tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed run that reached this step too
            os.makedirs(tmp)
        self._barrier()

        model_sd = get_model_state_dict(self.model)
        if model_only:
            model_sd = {k: v.to(self.export_dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
            state: dict[str, Any] = {"model": model_sd}
        else:
            state = {"model": model_sd, "optim": get_optimizer_state_dict(self.model, self.optimizer)}
        self._write_small_files(tmp, step, model_sd, model_only)

        if self.is_async and not model_only:
            response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.pg)
            # Newer torch returns an AsyncSaveResponse (staging + upload futures) when the
            # stager is asynchronous; 2.11 and 2.13 return the upload future here.
            future = getattr(response, "upload_completion", response)
            self._pending = _Pending(step, tmp, final, future, started)
            if self.rank == 0:
                logger.info(f"checkpoint step {step}: staged in {time.monotonic() - started:.2f}s, writing in background")
        else:
            dcp.save(state, checkpoint_id=tmp, process_group=self.pg, no_dist=not self.distributed)
            self._pending = _Pending(step, tmp, final, None, started)
            self._finish_pending()
            self._barrier()

    def _write_small_files(self, tmp: str, step: int, model_sd: dict, model_only: bool) -> None:
        _save_file(_rng_state(), os.path.join(tmp, f"rng-rank{self.rank}.pt"))
        if self.rank != 0:
            return
        trainer_state = {
            "step": step,
            "model_only": model_only,
            "world_size": self.world_size,
            "lr_scheduler": None if model_only or self.lr_scheduler is None else self.lr_scheduler.state_dict(),
            "dataloader": None if model_only or self.dataloader is None else self.dataloader.state_dict(),
            "extra": self.extra_state() if self.extra_state is not None else {},
        }
        _save_file(trainer_state, os.path.join(tmp, TRAINER_STATE))
        _save_file(self.config_toml, os.path.join(tmp, CONFIG_TOML))
        fingerprint = {"params": param_shapes(model_sd), "model_args": self.model_args}
        _save_file(json.dumps(fingerprint, indent=1, sort_keys=True), os.path.join(tmp, FINGERPRINT))

    def _finish_pending(self) -> None:
        """Wait for the pending write, then (rank 0) publish it by renaming and prune old ones.

        Rank 0's DCP save returns only after every rank's data is written and the
        global `.metadata` is on disk, so rank 0 can rename without a barrier.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        if self.rank != 0:
            return
        hold = float(os.environ.get(HOLD_ENV, "0"))
        if hold > 0:
            time.sleep(hold)
        if os.path.isdir(pending.final):  # written by an earlier run that got this far
            shutil.rmtree(pending.final + ".old", ignore_errors=True)
            os.rename(pending.final, pending.final + ".old")
        os.rename(pending.tmp, pending.final)
        _fsync_dir(self.folder)
        self._prune(keep=pending.step)
        logger.info(f"checkpoint step {pending.step} saved to {pending.final} in {time.monotonic() - pending.started:.2f}s")

    def _prune(self, keep: int) -> None:
        """Remove leftovers and all but the newest keep_latest_k complete checkpoints.

        Runs right after the save of step `keep` completed, when no other save is in
        flight, so every `.tmp` folder here is from a crash. Step `keep` itself is never
        removed, even if a run resumed from an older step left newer ones behind."""
        for name in os.listdir(self.folder):
            if _LEFTOVER.match(name):
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        k = self.cfg.keep_latest_k
        if k > 0:
            for step in complete_steps(self.folder)[:-k]:
                if step == keep:
                    continue
                path = step_dir(self.folder, step)
                os.rename(path, path + ".old")  # never leave a half-deleted "complete" folder
                shutil.rmtree(path + ".old", ignore_errors=True)

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    # ---------------------------------------------------------------- load

    def load(self) -> int:
        """Restore the checkpoint picked by load_step (-1 = newest complete); return its step, or 0 if none."""
        if not self.enable:
            return 0
        self._finish_pending()
        path = self._choose()
        if path is None:
            if self.rank == 0:
                logger.info(f"no checkpoint in {self.folder}; starting from step 0")
            return 0

        trainer_state = read_trainer_state(path)
        model_sd = get_model_state_dict(self.model)
        self._check_fingerprint(path, model_sd)
        model_only = trainer_state["model_only"]
        state: dict[str, Any] = {"model": model_sd}
        if not model_only:
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.pg, no_dist=not self.distributed)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
            raise CheckpointError(
                f"checkpoint {path} is unreadable ({_root_cause(e)}). "
                "Set checkpoint.load_step to another complete step, or move that folder away."
            ) from e
        set_model_state_dict(self.model, state["model"])
        if model_only:
            if self.rank == 0:
                logger.warning(f"{path} holds model weights only: optimizer, scheduler and data state start fresh")
        else:
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            if self.lr_scheduler is not None and trainer_state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
            if self.dataloader is not None and trainer_state["dataloader"] is not None:
                self.dataloader.load_state_dict(trainer_state["dataloader"])
            self._restore_rng(path, trainer_state["world_size"])
        self.restored_extra_state = trainer_state["extra"]
        step = trainer_state["step"]
        if self.rank == 0:
            logger.info(f"resumed from checkpoint step {step} ({path})")
        return step

    def _choose(self) -> str | None:
        """Rank 0 picks the folder and tells the others, so all ranks load the same one."""
        choice: list[Any] = [None]
        if self.rank == 0:
            steps = complete_steps(self.folder)
            want = self.cfg.load_step
            if want == -1:
                choice[0] = steps[-1] if steps else None
            elif want in steps:
                choice[0] = want
            else:
                choice[0] = (
                    f"checkpoint.load_step = {want} but {self.folder} has no complete step-{want} "
                    f"(complete steps: {', '.join(map(str, steps)) or 'none'}). "
                    "Pass one of those, or -1 for the newest."
                )
        if self.distributed:
            dist.broadcast_object_list(choice, src=0, group=self.pg)
        if isinstance(choice[0], str):
            raise CheckpointError(choice[0])
        return None if choice[0] is None else step_dir(self.folder, choice[0])

    def _check_fingerprint(self, path: str, model_sd: dict) -> None:
        file = os.path.join(path, FINGERPRINT)
        try:
            with open(file) as f:
                fingerprint = json.load(f)
            saved = fingerprint["params"]
        except Exception as e:
            raise CheckpointError(f"checkpoint file {file} is missing or corrupt ({type(e).__name__}: {e}).") from e
        here = param_shapes(model_sd)
        differ = sorted(k for k in here.keys() & saved.keys() if here[k] != saved[k])
        absent = sorted(here.keys() - saved.keys())
        unknown = sorted(saved.keys() - here.keys())
        problems = []
        if differ:
            k = differ[0]
            problems.append(f"{len(differ)} param shapes differ (e.g. {k}: {saved[k]} saved, {here[k]} now)")
        if absent:
            problems.append(f"{len(absent)} params of this model are not in it (e.g. {absent[0]})")
        if unknown:
            problems.append(f"{len(unknown)} saved params are not in this model (e.g. {unknown[0]})")
        if problems:
            raise CheckpointError(
                f"checkpoint {path} was saved from a different model: {'; '.join(problems)}. "
                "Use another checkpoint.folder or job.dump_folder for this model, or the model config that wrote it."
            )
        saved_args = fingerprint.get("model_args")
        if self.rank == 0 and saved_args and self.model_args and saved_args != self.model_args:
            keys = sorted(k for k in saved_args.keys() | self.model_args.keys() if saved_args.get(k) != self.model_args.get(k))
            logger.warning(f"model args differ from checkpoint {path} in {', '.join(keys)} (shapes match; loading)")

    def _restore_rng(self, path: str, saved_world_size: int) -> None:
        file = os.path.join(path, f"rng-rank{self.rank}.pt")
        if saved_world_size != self.world_size or not os.path.isfile(file):
            if self.rank == 0:
                logger.info(f"RNG state not restored: saved by {saved_world_size} ranks, running on {self.world_size}")
            return
        _set_rng_state(torch.load(file, map_location="cpu", weights_only=True))
