"""Learning-rate schedule shapes."""

import pytest
import torch

from trainer.config import LRScheduler, Optimizer
from trainer.optim import build_lr_scheduler, build_optimizer, lr_factor


def test_warmup_then_linear_decay_to_min():
    cfg = LRScheduler(warmup_steps=4, decay_type="linear", min_lr_factor=0.1)
    f = [lr_factor(s, total_steps=14, cfg=cfg) for s in range(1, 15)]
    assert f[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert f[4] == pytest.approx(1.0 - 0.9 / 10)
    assert f[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[4:], f[5:]))


def test_decay_ratio_keeps_stable_phase():
    cfg = LRScheduler(warmup_steps=2, decay_ratio=0.2, decay_type="cosine", min_lr_factor=0.0)
    f = [lr_factor(s, total_steps=20, cfg=cfg) for s in range(1, 21)]
    assert f[2:16] == pytest.approx([1.0] * 14)
    assert f[-1] == pytest.approx(0.0)
    assert f[17] == pytest.approx(0.5 * (1 + torch.cos(torch.tensor(torch.pi * 2 / 4)).item()))


def test_constant():
    cfg = LRScheduler(warmup_steps=0, decay_type="constant")
    assert [lr_factor(s, total_steps=5, cfg=cfg) for s in range(1, 6)] == [1.0] * 5


def test_scheduler_drives_optimizer():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, Optimizer(lr=1.0), torch.device("cpu"))
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=3, decay_type="constant"), total_steps=10)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.25, 0.5, 0.75, 1.0])
