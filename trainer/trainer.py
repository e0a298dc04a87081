"""The training loop: one object that owns the model, optimizer, data, metrics and checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from models import get_model_spec
from parallel.compile import compile_forward_loss
from parallel.data_parallel import describe as describe_data_parallel
from parallel.grad_clip import clip_grad_norm_
from parallel.loss import cross_entropy_loss
from parallel.mesh import ParallelDims
from trainer.build import DTYPES, build_model, parallel_flags
from trainer.checkpoint import CheckpointManager
from trainer.compile_health import CompileHealth
from trainer.config import JobConfig, to_toml
from trainer.data import build_dataloader
from trainer.export import export_hf
from trainer.metrics import MetricsLogger
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.preemption import PreemptionHandler
from trainer.profiling import maybe_profile, maybe_memory_snapshot
from trainer.tokenizer import Tokenizer


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/Inf; the run stops before saving that state."""


def log0(msg: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[weft] {msg}", flush=True)


class Trainer:
    def __init__(self, cfg: JobConfig, *, tokenizer: Tokenizer, model_args: object, dims: ParallelDims, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.dims = dims
        self.rank = dist.get_rank()
        self.tokenizer = tokenizer
        self.mesh = dims.build_mesh(device.type)
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.flags = parallel_flags(cfg, dims, device)
        spec = get_model_spec(cfg.model.name)

        self.model = build_model(cfg, spec, model_args, self.mesh, dims, self.flags, device)
        self.num_params = self.model.num_params()
        self.flops_per_token = self.model.flops_per_token(cfg.training.seq_len)
        log0(f"model {cfg.model.name} {cfg.model.flavor}: {self.num_params:,} parameters, "
             f"mesh dp={dims.dp} x tp={dims.tp}, sequence_parallel={self.flags.sequence_parallel}, "
             f"loss_parallel={self.flags.loss_parallel}, param dtype {self.flags.param_dtype}, data parallel: "
             f"{describe_data_parallel(self.flags.data_parallel_engine, cfg.parallelism.data_parallel_engine, dims.dp)}")

        self.optimizer = build_optimizer(self.model, cfg.optimizer, device)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.dataloader = build_dataloader(
            cfg.training, tokenizer, dp_rank=self.dp_rank, dp_degree=dims.dp, device=device,
            dump_folder=cfg.job.dump_folder,
        )
        self.val_loader = None
        if cfg.validation.enable:
            self.val_loader = build_dataloader(
                cfg.training, tokenizer, dp_rank=self.dp_rank, dp_degree=dims.dp, device=device,
                dump_folder=cfg.job.dump_folder, split="validation",
                dataset_path=cfg.validation.dataset_path or None,
            )
        self.loss_fn = lambda logits, labels: cross_entropy_loss(logits, labels, tokenizer.n_words)
        # model + loss: one compiled graph under whole-model compile (the loss is looked up on
        # self at each call, so it can be swapped, e.g. by tests).
        self.forward_loss = compile_forward_loss(
            self.model, lambda logits, labels: self.loss_fn(logits, labels), cfg.compile,
            fullgraph=self.flags.whole_graph,
        )

        self.step = 0
        self.compile_health = CompileHealth(cfg.compile, dump_folder=cfg.job.dump_folder, rank=self.rank) if cfg.compile.enable else None
        self.metrics = MetricsLogger(
            cfg.metrics, dump_folder=cfg.job.dump_folder, rank=self.rank, device=device,
            flops_per_token=self.flops_per_token, total_steps=cfg.training.steps,
            compile_health=self.compile_health,
        )
        self.checkpointer = CheckpointManager(
            cfg.checkpoint, dump_folder=cfg.job.dump_folder, model=self.model, optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler, dataloader=self.dataloader, config_toml=to_toml(cfg),
            model_fingerprint=dataclasses.asdict(model_args),
        )
        self.model_args = model_args
        signals = (signal.SIGTERM, signal.SIGUSR1) if cfg.checkpoint.save_on_sigusr1 else (signal.SIGTERM,)
        self.preemption = PreemptionHandler(signals)

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.flags.loss_parallel else contextlib.nullcontext()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward every micro-batch, clip, step. Returns (local mean loss, global grad norm)."""
        accum = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for inputs, labels in micro_batches:
            with self._loss_context():
                loss = self.forward_loss(inputs, labels) / accum
                loss.backward()
            loss_sum += loss.detach()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm

    def _dp_mean(self, value: torch.Tensor) -> float:
        value = value.detach().clone()
        dist.all_reduce(value, group=self.mesh["dp"].get_group())
        return value.item() / self.dims.dp

    def validate(self) -> dict[str, float]:
        """Held-out loss over `validation.steps` global batches.

        Runs the very forward that training runs: train mode (Llama has no dropout) and grad
        mode on, with the loss detached so each batch's graph is freed at once. Compiled
        regions guard on both flags, so `eval()` or `no_grad()` here would compile a second
        version of every region on the first validation, which is what users see as
        "recompiles"; this costs forward activations of one micro-batch, as training does.
        """
        self.val_loader.reset()
        total = torch.zeros((), device=self.device)
        count = 0
        for _ in range(self.cfg.validation.steps):
            for inputs, labels in self.val_loader.next_step():
                with self._loss_context():
                    loss = self.forward_loss(inputs, labels)
                total += loss.detach()
                del loss  # free this batch's graph before the next forward
                count += 1
        loss = self._dp_mean(total / count)
        return {"validation/loss": loss, "validation/perplexity": math.exp(min(loss, 50.0))}

    def train(self) -> None:
        cfg = self.cfg
        self.step = self.checkpointer.load()
        if self.step:
            log0(f"resumed from step {self.step}")
        gc.disable()
        gc.collect()
        tokens_per_step = self.dataloader.grad_accum_steps * cfg.training.local_batch_size * cfg.training.seq_len
        tokens_since_log = 0
        with maybe_profile(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=self.rank, start_step=self.step) as profiler, \
                maybe_memory_snapshot(cfg.profiling, dump_folder=cfg.job.dump_folder, rank=self.rank, device=self.device, start_step=self.step) as snapshot:
            while self.step < cfg.training.steps:
                self.step += 1
                if self.step % cfg.training.gc_freq == 0:
                    gc.collect(1)
                self.metrics.step_begin()
                batches = self.dataloader.next_step()
                self.metrics.data_loaded()
                lr = self.lr_scheduler.get_last_lr()[0]
                loss, grad_norm = self.train_step(batches)
                tokens_since_log += tokens_per_step // self.dims.tp
                if not torch.isfinite(loss + grad_norm).item():
                    raise NonFiniteLossError(
                        f"non-finite loss or gradient norm at step {self.step} (loss={loss.item()}, "
                        f"grad_norm={grad_norm.item()}); stopping without saving this state."
                    )
                if self.compile_health is not None:
                    self.compile_health.check(self.step)  # ends the warm-up itself
                last = self.step == cfg.training.steps
                if self.metrics.should_log(self.step) or last:
                    self.metrics.log(self.step, loss=self._dp_mean(loss), grad_norm=grad_norm.item(), lr=lr,
                                     tokens=tokens_since_log)
                    tokens_since_log = 0
                if self.val_loader is not None and (self.step % cfg.validation.freq == 0 or last):
                    self.metrics.log_scalars(self.step, self.validate())
                stop = self.preemption.should_stop()
                if stop and not last and cfg.checkpoint.enable:
                    self.checkpointer.save(self.step)  # full state, even with model_only_final
                else:
                    self.checkpointer.maybe_save(self.step, last=last)
                profiler.step()
                snapshot.step()
                if stop:
                    log0(f"preemption signal received: saved step {self.step}, exiting")
                    break
        self.checkpointer.wait()
        if cfg.checkpoint.export_hf and self.step == cfg.training.steps:
            out = os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder, "hf")
            export_hf(self.model, self.model_args, out, dtype=DTYPES[cfg.checkpoint.export_dtype],
                      vocab_size=self.tokenizer.n_words)
            log0(f"exported Hugging Face Llama weights to {out}")

    def close_local(self) -> None:
        """Cleanup without collectives, for an error that may have hit this rank alone."""
        gc.enable()
        self.preemption.close()
        self.metrics.close()

    def close(self) -> None:
        gc.enable()
        self.preemption.close()
        self.checkpointer.close()
        if self.compile_health is not None:
            self.compile_health.write_report()
            self.compile_health.close()
        self.metrics.close()
