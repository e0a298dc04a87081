"""AdamW and the warmup / stable / decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, cfg: Optimizer, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable params (DTensors included): fused on CUDA, foreach on CPU."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=impl == "fused",
        foreach=impl == "foreach",
    )


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
