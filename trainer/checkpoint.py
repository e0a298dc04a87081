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
        manifest.json         size and crc32 of every file above (checkpoint_manifest)
    step-<N>.tmp/             being written, or left by a crashed save
    step-<N>.old/             being deleted

A checkpoint is written into `step-<N>.tmp/` and renamed to `step-<N>/` by rank 0
only once every rank's data and DCP's `.metadata` are on disk: the rename is the
completion marker, so a crash at any point leaves the previous checkpoints intact
and `load()` never sees a partial one. Leftover `.tmp`/`.old` folders are ignored
and removed by the next successful save.

What is saved is checked first: a model whose parameters hold NaN/Inf is never saved
(NonFiniteError), and a save that fails to write (a full disk) removes its `.tmp`
folder and stops the run (CheckpointWriteError), leaving the previous checkpoints as they
were. On resume, files are checked against the manifest (falling back to the newest
checkpoint that passes) and read without running code from them (checkpoint_safety).
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from trainer import checkpoint_manifest as manifest
from trainer.checkpoint_safety import CheckpointReadError, iter_causes, root_cause, safe_dcp_load
from trainer.errors import CheckpointError, CheckpointWriteError, ConfigError, NonFiniteError
from trainer.optim import apply_hyperparameters, hyperparameters

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
    state = _load_small_file(file)
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint file {file} is corrupt (not a trainer state dict). "
                              "Set checkpoint.load_step to another complete step, or move that folder away.")
    return state


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
    """Write text/bytes as is, anything else with torch.save; fsync so the rename never publishes a torn file.

    torch.save goes to memory first: written straight to the file, a full disk surfaces as
    torch's "enforce fail at inline_container.cc" instead of the OSError (ENOSPC) it is."""
    if not isinstance(obj, (bytes, str)):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        obj = buffer.getbuffer()
    with open(path, "wb") as f:
        f.write(obj.encode() if isinstance(obj, str) else obj)
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


def _load_small_file(file: str) -> Any:
    """torch.load(weights_only=True) of one of our own small files, failing in one line."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint file {file} is missing or corrupt ({root_cause(e)}). "
            "Set checkpoint.load_step to another complete step, or move that folder away."
        ) from None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _folder_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file(follow_symlinks=False))


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
        # Runs an async save's manifest after its upload, in the background like the upload.
        self._sealer = ThreadPoolExecutor(max_workers=1) if self.is_async else None

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
        if self._sealer is not None:
            self._sealer.shutdown()

    def _save(self, step: int, *, model_only: bool) -> None:
        self._finish_pending()  # never two saves at once
        started = time.monotonic()
        model_sd = get_model_state_dict(self.model)
        if model_only:
            model_sd = {k: v.to(self.export_dtype) if v.is_floating_point() else v for k, v in model_sd.items()}
        self._check_finite(step, model_sd)
        final = step_dir(self.folder, step)
        tmp = final + ".tmp"
        try:
            self._agree(lambda: self._make_tmp(tmp) if self.rank == 0 else None)  # also the barrier before writing
            self._agree(lambda: self._write_small_files(tmp, step, model_sd, model_only))
            state: dict[str, Any] = {"model": model_sd}
            if not model_only:
                state["optim"] = get_optimizer_state_dict(self.model, self.optimizer)
            if self.is_async and not model_only:
                response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.pg)
                # Newer torch returns an AsyncSaveResponse (staging + upload futures) when the
                # stager is asynchronous; 2.11 and 2.13 return the upload future here.
                upload = getattr(response, "upload_completion", response)
                future = self._sealer.submit(self._seal_after, upload, tmp)
                self._pending = _Pending(step, tmp, final, future, started)
                if self.rank == 0:
                    logger.info(f"checkpoint step {step}: staged in {time.monotonic() - started:.2f}s, writing in background")
                return
            dcp.save(state, checkpoint_id=tmp, process_group=self.pg, no_dist=not self.distributed)
            sealed = self._seal(tmp)
        except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
            self._fail_save(step, tmp, e)
        self._pending = _Pending(step, tmp, final, None, started)
        self._finish_pending(sealed)
        self._barrier()

    @torch.no_grad()
    def _check_finite(self, step: int, model_sd: dict[str, Any]) -> None:
        """Refuse to save NaN/Inf weights: one fused reduction over the local shards, one all-reduce.

        `torch._foreach_norm` (what clip_grad_norm_ uses; torch 2.11-2.14) gives every
        tensor's L1 norm in one kernel per dtype: NaN and Inf always propagate through its
        sum. Huge finite weights can overflow it too, so a tensor it flags is confirmed
        with `isfinite` before it counts. Collective: every rank raises or none does."""
        names = [k for k, v in model_sd.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
        local = [_local(model_sd[k]) for k in names]
        bad = torch.zeros(len(names), dtype=torch.int32)
        if local:
            norms = torch._foreach_norm(local, 1)
            suspects = (~torch.stack([n.float() for n in norms]).isfinite()).nonzero().flatten().tolist()
            for i in suspects:
                bad[i] = int(not torch.isfinite(local[i]).all())
        if self.distributed:
            dist.all_reduce(bad, group=self.pg)
        if bad.any():
            which = [names[i] for i in bad.nonzero().flatten().tolist()]
            newest = complete_steps(self.folder)
            raise NonFiniteError(
                f"the model holds NaN/Inf at step {step} ({len(which)} tensors, e.g. {which[0]}); not saving it. "
                f"The newest checkpoint is {f'step-{newest[-1]}' if newest else 'none'} in {self.folder}. "
                "Lower optimizer.lr or optimizer.weight_decay, or raise lr_scheduler.warmup_steps."
            )

    @staticmethod
    def _make_tmp(tmp: str) -> None:
        shutil.rmtree(tmp, ignore_errors=True)  # a crashed run that reached this step too
        os.makedirs(tmp)

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

    def _seal(self, tmp: str) -> float:
        """Write `tmp/manifest.json` covering every file of the save; return the seconds it took.

        Collective: rank 0 lists the folder, each rank checksums its share of the files (those
        it wrote, as far as their names tell, then the rest balanced by size), rank 0 writes."""
        started = time.monotonic()
        listing = [manifest.list_files(tmp) if self.rank == 0 else None]
        if self.distributed:
            dist.broadcast_object_list(listing, src=0, group=self.pg)
        mine = manifest.assign(listing[0], self.world_size)[self.rank]
        parts = self._agree(lambda: manifest.checksum(tmp, mine))
        entries = {name: entry for part in parts for name, entry in part.items()}
        self._agree(lambda: manifest.write(tmp, entries) if self.rank == 0 else None)
        return time.monotonic() - started

    def _seal_after(self, upload: Future, tmp: str) -> float:
        upload.result()
        return self._seal(tmp)

    def _agree(self, fn: Callable[[], Any]) -> list[Any]:
        """Run `fn` on every rank and return every rank's result. If it raised on any rank, raise
        on all (that rank's own error; the others get its kind and text), so no rank is left
        waiting in a collective alone. Collective."""
        try:
            result, error = fn(), None
        except Exception as e:
            result, error = None, e
        if not self.distributed:
            if error is not None:
                raise error
            return [result]
        report = None
        if error is not None:
            report = (isinstance(error, CheckpointError), getattr(error, "errno", None), root_cause(error))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (result, report), group=self.pg)
        if error is not None:
            raise error
        for rank, (_, failed) in enumerate(gathered):
            if failed is not None:
                is_checkpoint_error, code, text = failed
                if is_checkpoint_error:
                    raise CheckpointError(f"rank {rank}: {text}")
                raise OSError(code, f"rank {rank}: {text}") if code else RuntimeError(f"rank {rank}: {text}")
        return [r for r, _ in gathered]

    def _fail_save(self, step: int, tmp: str, error: BaseException) -> None:
        """Remove the partial save and raise CheckpointWriteError in one line (disk full: where, how much free)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        newest = complete_steps(self.folder)
        kept = (f"the previous checkpoint step-{newest[-1]} is intact ({_size_text(_folder_bytes(step_dir(self.folder, newest[-1])))})"
                if newest else "there is no earlier checkpoint")
        if any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT) for c in iter_causes(error)):
            disk = _mount_point(self.folder)
            free = shutil.disk_usage(self.folder).free
            raise CheckpointWriteError(
                f"no space left on the disk of {self.folder} (mounted at {disk}) while saving checkpoint step {step}: "
                f"{_size_text(free)} free after removing the partial save; {kept}. Free space on {disk}, lower "
                "checkpoint.keep_latest_k, or set checkpoint.folder to an absolute path on another disk."
            ) from None
        raise CheckpointWriteError(
            f"could not write checkpoint step {step} to {tmp} ({root_cause(error)}); {kept}."
        ) from None

    def _finish_pending(self, sealed: float | None = None) -> None:
        """Wait for the pending write and its manifest, then (rank 0) publish it by renaming and prune old ones.

        Every rank's DCP save returns only after all data and the global `.metadata` are
        on disk, and the manifest is written by rank 0 after all ranks' checksums reached
        it, so rank 0 can rename without a barrier.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            try:
                sealed = pending.future.result()
            except (Exception, dcp.CheckpointException) as e:
                self._fail_save(pending.step, pending.tmp, e)
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
        logger.info(f"checkpoint step {pending.step} saved to {pending.final} in "
                    f"{time.monotonic() - pending.started:.2f}s (manifest {sealed:.2f}s)")

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
        """Restore the checkpoint picked by load_step (-1 = newest that verifies); return its step, or 0 if none.

        The optimizer's hyper-parameters and the schedule's peak lr are the ones this run was
        built with (its config), not the saved ones; each change is logged."""
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
            safe_dcp_load(state, path, self.pg)
        except CheckpointReadError as e:
            raise CheckpointError(
                f"{e}. Set checkpoint.load_step to another complete step, or move that folder away."
            ) from None
        set_model_state_dict(self.model, state["model"])
        if model_only:
            if self.rank == 0:
                logger.warning(f"{path} holds model weights only: optimizer, scheduler and data state start fresh")
        else:
            configured = hyperparameters(self.optimizer, self.lr_scheduler) if self.lr_scheduler is not None else None
            set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            if self.lr_scheduler is not None and trainer_state["lr_scheduler"] is not None:
                self.lr_scheduler.load_state_dict(trainer_state["lr_scheduler"])
            if configured is not None:
                for change in apply_hyperparameters(self.optimizer, self.lr_scheduler, configured):
                    if self.rank == 0:
                        logger.info(f"{change} (config differs from checkpoint; using the config)")
            if self.dataloader is not None and trainer_state["dataloader"] is not None:
                self.dataloader.load_state_dict(trainer_state["dataloader"])
            self._restore_rng(path, trainer_state["world_size"])
        self.restored_extra_state = trainer_state["extra"]
        step = trainer_state["step"]
        if self.rank == 0:
            logger.info(f"resumed from checkpoint step {step} ({path})")
        return step

    def _choose(self) -> str | None:
        """The folder to load: load_step, or the newest complete checkpoint that verifies.

        Rank 0 picks the candidates and tells the others, so all ranks load the same one."""
        choice: list[Any] = [None]
        if self.rank == 0:
            steps = complete_steps(self.folder)
            want = self.cfg.load_step
            if want == -1:
                choice[0] = steps[::-1]
            elif want in steps:
                choice[0] = [want]
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
        candidates = choice[0]
        if not candidates:
            return None
        if not self.cfg.verify:
            return step_dir(self.folder, candidates[0])
        failures = []
        for step in candidates:
            path = step_dir(self.folder, step)
            problems = self._verify(path)
            if not problems:
                if failures and self.rank == 0:
                    logger.warning(f"resuming from {path} instead, the newest checkpoint that verifies")
                return path
            failures.append(problems[0])
            if self.rank == 0:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                logger.warning(f"checkpoint {path} is damaged, skipping it: {problems[0]}{more}")
        raise CheckpointError(
            f"no checkpoint in {self.folder} matches its manifest ({'; '.join(failures)}). "
            "Restore the files, point checkpoint.load_step elsewhere, or pass --checkpoint.no-verify to load anyway."
        )

    def _verify(self, path: str) -> list[str]:
        """Damage found in `path` against its manifest; [] when it matches or has none. Collective:
        the files are split over the ranks so each is read once."""
        head: list[Any] = [None]
        if self.rank == 0:
            try:
                head[0] = manifest.read(path)
            except manifest.ManifestError as e:
                head[0] = str(e)
        if self.distributed:
            dist.broadcast_object_list(head, src=0, group=self.pg)
        entries = head[0]
        if isinstance(entries, str):
            return [entries]
        if entries is None:
            if self.rank == 0:
                logger.warning(f"checkpoint {path} has no {manifest.MANIFEST} (saved by an older weft): loading it unverified")
            return []
        mine = manifest.assign({name: e["size"] for name, e in entries.items()}, self.world_size)[self.rank]
        found = manifest.compare(path, {name: entries[name] for name in mine})
        if not self.distributed:
            return found
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, found, group=self.pg)
        return [p for part in everyone for p in part]

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
        if saved_world_size != self.world_size:
            if self.rank == 0:
                logger.info(f"RNG state not restored: saved by {saved_world_size} ranks, running on {self.world_size}")
            return
        self._agree(lambda: self._restore_rng_file(os.path.join(path, f"rng-rank{self.rank}.pt")))

    @staticmethod
    def _restore_rng_file(file: str) -> None:
        state = _load_small_file(file)
        try:
            _set_rng_state(state)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint file {file} is corrupt (not an RNG state: {root_cause(e)}). "
                "Set checkpoint.load_step to another complete step, or move that folder away."
            ) from None
