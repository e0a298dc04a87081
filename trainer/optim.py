"""AdamW and the warmup / stable / decay learning-rate schedule."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
from typing import Iterable

import torch
from torch import nn

from parallel.compact_gradients import CompactGradients
from parallel.grad_clip import TensorNorms, clip_grads_, fp64_norms, global_norm
from trainer.config import LRScheduler, Optimizer
from trainer.overlapped_step import OverlappedStep
from trainer.triton_adamw import TritonAdamW


def triton_available() -> bool:
    """Whether Triton kernels can be built here: triton is installed, and a C compiler is found
    where triton looks for one (it builds its kernel launcher with it at first use)."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")
    return importlib.util.find_spec("triton") is not None and compiler is not None


def optimizer_implementation(cfg: Optimizer, device_type: str) -> str:
    """`optimizer.implementation` with "auto" resolved: on CUDA the Triton AdamW
    (trainer/triton_adamw.py; it moved the 3B step's bytes 12-19% faster than torch's fused
    kernel on an H100, docs/performance.md), or torch's fused AdamW where Triton kernels cannot
    be built; foreach elsewhere."""
    if cfg.implementation == "auto":
        if device_type != "cuda":
            return "foreach"
        return "triton" if triton_available() else "fused"
    return cfg.implementation


def build_optimizer(
    model: nn.Module, cfg: Optimizer, device: torch.device, compact: CompactGradients | None = None
) -> torch.optim.Optimizer:
    """AdamW over the trainable params (DTensors included): the Triton AdamW, which reads compact
    gradients (`compact`) where they are held and writes their weight copies in its step, or
    torch's fused (CUDA) or foreach (CPU) AdamW (whose writes `compact.refresh_copies` casts again)."""
    impl = optimizer_implementation(cfg, device.type)
    params = [p for p in model.parameters() if p.requires_grad]
    hyperparameters = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if impl == "triton":
        optimizer = TritonAdamW(params, **hyperparameters)
        if compact is not None:
            optimizer.gradient_of = compact.gradient_of
            optimizer.copy_of = compact.copy_of
        return optimizer
    return torch.optim.AdamW(params, fused=impl == "fused", foreach=impl == "foreach", **hyperparameters)


@torch.no_grad()
def clip_and_step(
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    compact: CompactGradients | None = None,
    overlapped: OverlappedStep | None = None,
    tensor_norms: TensorNorms = fp64_norms,
) -> torch.Tensor:
    """Clip the gradients to `max_norm` by their global norm, step, and return the norm before clipping.

    The update is memory-bound, and a separate clip reads and writes every fp32 gradient once
    more. A fused AdamW takes the clip into its kernel instead: it divides each gradient by
    the tensor in `optimizer.grad_scale` as it reads it; that attribute is how
    `torch.amp.GradScaler` hands its scale to fused optimizers (read by `Adam.step`, checked in
    torch 2.11 and 2.13; DTensor parameters take it as a replicated scalar). The divisor is the
    inverse of the factor `clip_grads_with_norm_` multiplies by, so the update differs from a
    separate clip by rounding only. Measured on an H200 (`scripts/bench_optimizer.py`): 42.1
    -> 38.7 ms per step at 3B, 93.0 -> 85.6 ms at 8B. Other implementations clip, then step.

    The Triton AdamW (trainer/triton_adamw.py) takes the clip the same way, without writing
    the divided gradients back.

    With `compact` (gradients held in the compute dtype, parallel/compact_gradients.py) the
    norm is taken over what is held. The Triton AdamW reads them as they are; other
    implementations step once per group of parameters whose gradients are widened back to
    fp32: AdamW's update is elementwise, so stepping in groups changes no bit, and only one
    group's fp32 gradients exist at a time.

    With `overlapped` (trainer/overlapped_step.py) the step is launched unit by unit and
    finishes during the next forward; the clip factor is computed here, before any unit steps.
    `tensor_norms` gives the gradients' per-tensor norms (those parallel/backward_grad_norms.py
    took during backward, where it did).
    """
    loose = [p for p in parameters if p.grad is not None]
    norm = global_norm([p.grad for p in loose] + (compact.gradients() if compact is not None else []), tensor_norms)
    fold_clip = max_norm > 0 and (bool(optimizer.defaults.get("fused")) or isinstance(optimizer, TritonAdamW))
    if fold_clip:
        optimizer.grad_scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0).reciprocal()
    reads_compact = compact is not None and isinstance(optimizer, TritonAdamW)
    try:
        for group in compact.materialized(loose) if compact is not None and not reads_compact else [loose]:
            if max_norm > 0 and not fold_clip:
                clip_grads_(group, max_norm, norm)
            if overlapped is not None:
                overlapped.step()
            else:
                optimizer.step()
        if reads_compact and overlapped is None:  # else each unit's next forward releases its gradients
            compact.release(compact.parameters)
    finally:
        if fold_clip:
            del optimizer.grad_scale
    return norm


def lr_factor(step: int, *, total_steps: int, cfg: LRScheduler) -> float:
    """Multiplier of the peak lr for optimizer step `step` (1-based).

    Linear warmup over `warmup_steps`, then constant until the last `decay_ratio` fraction of
    the run (all of the remaining steps when unset), then linear / cosine decay to
    `min_lr_factor` (or none with decay_type "constant").
    """
    warmup = cfg.warmup_steps
    if step <= warmup:
        return step / (warmup + 1)
    remaining = total_steps - warmup
    decay_steps = remaining if cfg.decay_ratio is None else round(total_steps * cfg.decay_ratio)
    decay_steps = min(decay_steps, remaining)
    decay_start = total_steps - decay_steps
    if cfg.decay_type == "constant" or step <= decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start) / decay_steps
    if cfg.decay_type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR whose internal counter starts at 1 for the first optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda last_epoch: lr_factor(last_epoch + 1, total_steps=total_steps, cfg=cfg)
    )


def hyperparameters(optimizer: torch.optim.Optimizer, lr_scheduler: torch.optim.lr_scheduler.LambdaLR) -> list[dict]:
    """Per param group: the peak lr (the schedule's base) and AdamW's betas, eps and weight_decay."""
    return [
        {"lr": peak, "betas": tuple(group["betas"]), "eps": group["eps"], "weight_decay": group["weight_decay"]}
        for group, peak in zip(optimizer.param_groups, lr_scheduler.base_lrs)
    ]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer, lr_scheduler: torch.optim.lr_scheduler.LambdaLR, new: list[dict]
) -> list[str]:
    """Put the config's hyper-parameters back after a resume restored the saved ones.

    `new` comes from `hyperparameters()` of the freshly built optimizer. Loading a checkpoint
    restores param_groups and the schedule's base lrs as saved; this sets them to `new`, so the
    lr of the resumed step is the new peak times the (new config's) schedule factor at that
    step, exactly what a fresh run with this config would use. Returns one line per changed
    config key, e.g. "optimizer.lr: 0.0008 -> 0.5".
    """
    old = hyperparameters(optimizer, lr_scheduler)
    changes = []
    for key, (was, now) in {
        "lr": (old[0]["lr"], new[0]["lr"]),
        "beta1": (old[0]["betas"][0], new[0]["betas"][0]),
        "beta2": (old[0]["betas"][1], new[0]["betas"][1]),
        "eps": (old[0]["eps"], new[0]["eps"]),
        "weight_decay": (old[0]["weight_decay"], new[0]["weight_decay"]),
    }.items():
        if was != now:
            changes.append(f"optimizer.{key}: {was:g} -> {now:g}")
    lr_scheduler.base_lrs = [h["lr"] for h in new]
    lrs = [base * factor(lr_scheduler.last_epoch) for base, factor in zip(lr_scheduler.base_lrs, lr_scheduler.lr_lambdas)]
    for group, hp, lr in zip(optimizer.param_groups, new, lrs):
        group.update(betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"], initial_lr=hp["lr"], lr=lr)
    # get_last_lr() returns `_last_lr`, which LRScheduler.step() sets from the groups' lr
    # (torch 2.11-2.13); set it the same way so the resumed step logs the lr it uses.
    lr_scheduler._last_lr = lrs
    return changes
