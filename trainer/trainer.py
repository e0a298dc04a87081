"""The training loop: one object that owns the model, optimizer, data, metrics and checkpoints.

The step keeps the host off the device's critical path: the loss, gradient norm and a
non-finite flag stay on the device and are read once per logged step (and before a save),
and preemption is agreed with a CPU all-reduce every few steps, so nothing in a plain step
waits for the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor.parallel import loss_parallel

from parallel.activation_offload import ActivationOffload
from parallel.backward_grad_norms import BackwardGradNorms, unit_holders
from parallel.compile import compile_forward_loss, cross_entropy_kernels
from parallel.data_parallel import compact_gradients, describe as describe_data_parallel
from parallel.fsdp import set_gradient_sync
from parallel.grad_clip import fp64_norms
from parallel.loss import cross_entropy_loss
from trainer.build import build_model
from trainer.checkpoint import CheckpointManager
from trainer.comm import set_timeout
from trainer.compile_health import CompileHealth
from trainer.config import DTYPES, to_toml
from trainer.data import build_dataloader
from trainer.errors import NonFiniteError
from trainer.export import export_hf
from trainer.initial_load import load_hf_weights
from trainer.metrics import MetricsLogger, Window
from trainer.optim import build_lr_scheduler, build_optimizer, clip_and_step, optimizer_implementation
from trainer.overlapped_step import OverlappedStep
from trainer.preemption import PreemptionHandler
from trainer.profiling import maybe_memory_snapshot, maybe_profile
from trainer.run import ResolvedRun
from trainer.step_readout import StepReadout

logger = logging.getLogger(__name__)


class _NonFiniteWatch:
    """Remembers, on the device, the first step whose loss or gradient norm was not finite.

    Updating it is two small device ops per step and never syncs. `first_bad` is staged with
    each logged step's values (read a step late); `first_bad_step()` reads it at once (a sync),
    which the trainer does before a save.
    """

    def __init__(self, device: torch.device) -> None:
        self.first_bad = torch.zeros((), dtype=torch.int64, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss + grad_norm) & (self.first_bad == 0)
        self.first_bad = torch.where(bad, torch.full_like(self.first_bad, step), self.first_bad)

    def first_bad_step(self) -> int:
        return int(self.first_bad.item())


@dataclasses.dataclass(frozen=True)
class _LoggedStep:
    """What the host knew of a logged step when its device values were staged."""

    window: Window
    lr: float
    extra: dict[str, float]


class Trainer:
    def __init__(self, run: ResolvedRun):
        cfg = self.cfg = run.cfg
        self.run = run
        self.device = run.device
        self.dims = run.dims
        self.rank = dist.get_rank()
        self.tokenizer = run.tokenizer
        self.meshes = run.dims.build_meshes(run.device.type)
        set_timeout(cfg.comm.init_timeout_seconds, self.meshes.process_groups())
        self.dp_rank = self.meshes.dp.get_local_rank()
        self.hf_adapter = run.spec.hf_adapter(run.model_args)

        self.model = build_model(run, self.meshes)
        self.num_params = self.model.num_params()
        self.flops_per_token = self.model.flops_per_token(cfg.training.seq_len)
        logger.info(f"{cfg.job.description}; resolved config:\n{to_toml(cfg)}")
        logger.info(
            f"model {cfg.model.name} {cfg.model.flavor}: {self.num_params:,} parameters, mesh dp_replicate="
            f"{run.dims.dp_replicate} x dp_shard={run.dims.dp_shard} x tp={run.dims.tp}, sequence_parallel={run.sequence_parallel}, loss_parallel={run.loss_parallel}, "
            f"param dtype {run.param_dtype}, global batch {run.global_batch_size} "
            f"({run.grad_accum_steps} micro-batch(es) of {cfg.training.local_batch_size} per rank), data parallel: "
            f"{describe_data_parallel(run.data_parallel_engine, cfg.parallelism.data_parallel_engine, run.dims.dp)}, "
            f"optimizer: {optimizer_implementation(cfg.optimizer, run.device.type)} AdamW, stepped "
            f"{'unit by unit, overlapped with the next forward' if run.overlap_step else 'after backward'}"
        )

        self.compact_gradients = None
        if run.compact_gradients:
            self.compact_gradients = compact_gradients(self.model, run.param_dtype, keep_copies=run.weight_copies)
        self.optimizer = build_optimizer(self.model, cfg.optimizer, run.device, self.compact_gradients)
        self.overlapped_step = None
        if run.overlap_step:
            release = self.compact_gradients.release if self.compact_gradients is not None else None
            self.overlapped_step = OverlappedStep(self.optimizer, run.spec.fsdp_units(self.model), run.device, release)
        self.backward_norms = self._backward_grad_norms() if run.backward_grad_norms else None
        self.activation_offload = None
        if cfg.activation_checkpoint.offload_blocks:
            copies = self.compact_gradients.copies() if self.compact_gradients is not None else []
            self.activation_offload = ActivationOffload(run.spec.blocks(self.model), cfg.activation_checkpoint.offload_blocks,
                                                        run.device, persistent=copies)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        loader_args = dict(dp_rank=self.dp_rank, dp_degree=run.dims.dp, device=run.device,
                           dump_folder=run.paths.dump, global_batch_size=run.global_batch_size)
        self.dataloader = build_dataloader(cfg.training, run.tokenizer, **loader_args,
                                           allow_data_change=cfg.checkpoint.allow_data_change)
        self.val_loader = None
        if cfg.validation.enable:
            self.val_loader = build_dataloader(cfg.training, run.tokenizer, **loader_args, split="validation",
                                               dataset_path=cfg.validation.dataset_path or None)
        n_words = run.tokenizer.n_words
        kernels = cross_entropy_kernels(cfg.compile)
        self.loss_fn = lambda logits, labels: cross_entropy_loss(logits, labels, n_words, kernels, overwrite_logits=True)
        # model + loss: one compiled graph under whole-model compile (the loss is looked up on
        # self at each call, so it can be swapped, e.g. by tests). A fused head computes the
        # loss itself: model(inputs, labels).
        separate_loss = None if run.fused_head_loss else (lambda logits, labels: self.loss_fn(logits, labels))
        self.forward_loss = compile_forward_loss(self.model, separate_loss, cfg.compile, fullgraph=run.whole_graph)

        self.step = 0
        self.compile_health: CompileHealth | None = None
        self.metrics: MetricsLogger | None = None
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=run.paths.dump, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, config_toml=to_toml(cfg),
            model_fingerprint=dataclasses.asdict(run.model_args),
        )
        signals = (signal.SIGTERM, signal.SIGUSR1) if cfg.checkpoint.save_on_sigusr1 else (signal.SIGTERM,)
        self.preemption = PreemptionHandler(signals, check_freq=cfg.checkpoint.preemption_check_freq)
        self.nonfinite = _NonFiniteWatch(run.device)
        self.readout: StepReadout[_LoggedStep] = StepReadout(run.device)
        self.defer_reduce_scatter = cfg.parallelism.gradient_sync == "step"

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.run.loss_parallel else contextlib.nullcontext()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step. Returns (local mean loss, global grad norm),
        both still on the device."""
        accum = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        self._refresh_weight_copies()
        for index, (inputs, labels) in enumerate(micro_batches):
            last = index == accum - 1
            if accum > 1:
                set_gradient_sync(self.model, reduce_scatter=last or not self.defer_reduce_scatter, all_reduce=last)
            if last and self.backward_norms is not None:
                self.backward_norms.arm()
            with self._loss_context():
                with self._offload_scope():
                    loss = self.forward_loss(inputs, labels) / accum
                self._finish_step()  # the forward settled every unit it ran; this catches any other
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = clip_and_step(self.optimizer, self.model.parameters(), self.cfg.training.max_norm,
                                  self.compact_gradients, self.overlapped_step,
                                  self.backward_norms.norms if self.backward_norms is not None else fp64_norms)
        if self.backward_norms is not None:
            self.backward_norms.disarm()
        self.lr_scheduler.step()
        if self.overlapped_step is None:  # else each unit's next forward releases its gradients
            self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _backward_grad_norms(self) -> BackwardGradNorms:
        """Gradient norms taken unit by unit during the last micro-batch's backward, where autograd
        (not a data-parallel wrapper) makes each gradient: so that after backward only the step
        is left on the critical path (with the overlapped step, only its first unit)."""
        holder_of = self.compact_gradients.holder_of if self.compact_gradients is not None else (lambda p: p)
        holders = unit_holders(self.run.spec.fsdp_units(self.model), self.model.parameters(), holder_of)
        return BackwardGradNorms(holders, fp64_norms, self.run.device)

    def _refresh_weight_copies(self) -> None:
        """Before a forward: cast again the weight copies of parameters written since their copy
        was made (initialization, a checkpoint load; the Triton AdamW writes them itself)."""
        if self.compact_gradients is not None:
            self.compact_gradients.refresh_copies()

    def _finish_step(self) -> None:
        """Wait for an overlapped optimizer step still running: before anything but the next
        forward reads parameters, optimizer state or gradients."""
        if self.overlapped_step is not None:
            self.overlapped_step.finish()

    def _offload_scope(self, offload: bool = True) -> contextlib.AbstractContextManager:
        return self.activation_offload.scope(offload) if self.activation_offload else contextlib.nullcontext()

    def _offload_metrics(self) -> dict[str, float]:
        """What activation offload moved in the last micro-batch's forward, and the fetches that came late."""
        if self.activation_offload is None:
            return {}
        return {"offload_gib": self.activation_offload.bytes_offloaded / 1024**3,
                "offload_late_fetches": self.activation_offload.late_fetches}

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the data-parallel ranks, on the device (a copy only where dp > 1)."""
        value = value.detach()
        if self.dims.dp > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.meshes.dp.get_group())
        return value

    def _dp_mean(self, value: torch.Tensor) -> float:
        return self._dp_sum(value).item() / self.dims.dp

    def _raise_if_nonfinite(self, bad: int | None = None) -> None:
        """Stop at the first non-finite step: `bad` as staged with a logged step, else read now."""
        bad = self.nonfinite.first_bad_step() if bad is None else bad
        if bad:
            raise NonFiniteError(
                f"non-finite loss or gradient norm at step {bad}; stopping without saving that state "
                "(the newest checkpoint on disk is from before it). Lower optimizer.lr or check the data."
            )

    def _stage_log(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, tokens: int) -> None:
        """Queue this logged step's values for the host (no sync): the loss summed over the
        data-parallel ranks, the gradient norm and the first non-finite step so far."""
        logged = _LoggedStep(self.metrics.end_window(self.step, tokens), lr,
                             {**self.dataloader.shares(), **self._offload_metrics()})
        self.readout.stage([self._dp_sum(loss), grad_norm, self.nonfinite.first_bad], logged)

    def _log_staged(self) -> None:
        """Read and log the staged step's values, if any: waits for that step to finish."""
        taken = self.readout.take()
        if taken is None:
            return
        (loss_sum, grad_norm, first_bad), logged = taken
        self._raise_if_nonfinite(int(first_bad))
        self.metrics.log(logged.window, loss=loss_sum / self.dims.dp, grad_norm=grad_norm, lr=logged.lr,
                         extra=logged.extra)

    def validate(self) -> dict[str, float]:
        """Held-out loss over `validation.steps` global batches.

        Runs the very forward that training runs: train mode (Llama has no dropout) and grad
        mode on, with the loss detached so each batch's graph is freed at once. Compiled
        regions guard on both flags, so `eval()` or `no_grad()` here would compile a second
        version of every region on the first validation, which is what users see as
        "recompiles"; this costs forward activations of one micro-batch, as training does.
        """
        self.val_loader.reset()
        self._refresh_weight_copies()
        total = torch.zeros((), device=self.device)
        count = 0
        for _ in range(self.cfg.validation.steps):
            for inputs, labels in self.val_loader.next_step():
                with self._loss_context(), self._offload_scope(offload=False):
                    loss = self.forward_loss(inputs, labels)
                total += loss.detach()
                del loss  # free this batch's graph before the next forward
                count += 1
        loss = self._dp_mean(total / count)
        return {"validation/loss": loss, "validation/perplexity": math.exp(min(loss, 50.0))}

    def _start(self) -> None:
        """Resume (or not), then open what records the run: only now, after every check of the
        resume passed, is anything written to the dump folder."""
        cfg, run = self.cfg, self.run
        self.step = self.checkpointer.load()
        if self.step and run.initial_load_path:
            logger.info(f"resumed from step {self.step}; checkpoint.initial_load_path not used")
        elif run.initial_load_path:  # only without a checkpoint to resume: a resume always wins
            load_hf_weights(self.model, self.hf_adapter, run.initial_load_path, vocab_size=self.tokenizer.n_words)
        if self.rank == 0:
            os.makedirs(run.paths.dump, exist_ok=True)
            with open(os.path.join(run.paths.dump, "config.toml"), "w") as f:
                f.write(to_toml(cfg))
        if cfg.compile.enable:
            self.compile_health = CompileHealth(cfg.compile, dump_folder=run.paths.dump, rank=self.rank,
                                                start_step=self.step)
        self.metrics = MetricsLogger(
            cfg.metrics, dump_folder=run.paths.dump, rank=self.rank, device=self.device,
            flops_per_token=self.flops_per_token, total_steps=cfg.training.steps,
            compile_health=self.compile_health, tb_folder=run.paths.tensorboard, start_step=self.step,
            config_text=to_toml(cfg),
        )

    def train(self) -> None:
        cfg = self.cfg
        self._start()
        gc.disable()
        gc.collect()
        tokens_per_step = self.run.grad_accum_steps * cfg.training.local_batch_size * cfg.training.seq_len
        tokens_since_log = 0
        first_step = True
        with maybe_profile(cfg.profiling, folder=self.run.paths.traces, rank=self.rank, start_step=self.step) as profiler, \
                maybe_memory_snapshot(cfg.profiling, folder=self.run.paths.memory_snapshots, rank=self.rank,
                                      device=self.device, start_step=self.step) as snapshot:
            while self.step < cfg.training.steps:
                self.step += 1
                if self.step % cfg.training.gc_freq == 0:
                    gc.collect(1)
                self.metrics.step_begin()
                batches = self.dataloader.next_step()
                self.metrics.data_loaded()
                lr = self.lr_scheduler.get_last_lr()[0]
                loss, grad_norm = self.train_step(batches)
                if first_step:  # compilation and the first collectives are behind us
                    set_timeout(cfg.comm.train_timeout_seconds, self.meshes.process_groups())
                    first_step = False
                self.nonfinite.update(self.step, loss, grad_norm)
                tokens_since_log += tokens_per_step // self.dims.tp
                if self.compile_health is not None:
                    self.compile_health.check(self.step)  # ends the warm-up itself
                self._log_staged()  # the last logged step's: this step is queued behind it by now
                last = self.step == cfg.training.steps
                if self.metrics.should_log(self.step) or last:
                    self._stage_log(loss, grad_norm, lr, tokens_since_log)
                    tokens_since_log = 0
                validate = self.val_loader is not None and (self.step % cfg.validation.freq == 0 or last)
                stop = self.preemption.should_stop(self.step) and not last
                save = stop or self.checkpointer.wants_save(self.step, last=last)
                if validate or save or last or not self.readout.deferred:
                    self._log_staged()  # at once on a CPU; before these, so records keep step order
                if validate:
                    with self.metrics.excluded():
                        self.metrics.log_scalars(self.step, self.validate())
                if save:
                    self._raise_if_nonfinite()
                    self._finish_step()
                with self.metrics.excluded():
                    if stop and cfg.checkpoint.enable:
                        self.checkpointer.save(self.step)  # full state, even with model_only_final
                    else:
                        self.checkpointer.maybe_save(self.step, last=last)
                profiler.step()
                snapshot.step()
                if stop:
                    logger.info(f"preemption: stopped after step {self.step}" + (", checkpoint saved" if cfg.checkpoint.enable else ""))
                    break
        self._finish_step()
        self.checkpointer.wait()
        if cfg.checkpoint.export_hf and self.step == cfg.training.steps:
            out = os.path.join(self.run.paths.checkpoint, "hf")
            export_hf(get_model_state_dict(self.model), self.hf_adapter, out,
                      dtype=DTYPES[cfg.checkpoint.export_dtype], vocab_size=self.tokenizer.n_words)

    def close_local(self) -> None:
        """Cleanup without collectives, for an error that may have hit this rank alone."""
        gc.enable()
        self.preemption.close()
        if self.compile_health is not None:
            self.compile_health.close()
        if self.metrics is not None:
            self.metrics.close()

    def close(self) -> None:
        gc.enable()
        self.preemption.close()
        self.checkpointer.close()
        if self.compile_health is not None:
            self.compile_health.write_report()
            self.compile_health.close()
        if self.metrics is not None:
            self.metrics.close()
