"""Learning-rate schedule shapes, and clipping folded into the fused AdamW step."""

import pytest
import torch

from trainer.config import LRScheduler, Optimizer
from parallel.grad_clip import clip_grad_norm_
from trainer.optim import build_lr_scheduler, build_optimizer, clip_and_step, lr_factor


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


@pytest.mark.parametrize("max_norm", [1.0, 1e6, 0.0])  # clipped, not clipped, clipping off
def test_clip_folded_into_fused_adamw_matches_a_separate_clip(max_norm):
    """Fused AdamW with the clip as its `grad_scale` divisor follows clip-then-step.

    Reference: the global-norm clip as its own pass, then the foreach AdamW, in fp32 on CPU.
    Six steps of gradients with norms from about 280 to 1,700, so max_norm 1 clips every step
    by a different factor (Adam alone is blind to a constant one). The two differ by the
    rounding of `g / (1 / c)` against `g * c` only (measured: 2.4e-7 at most on parameters of
    size ~1, torch 2.13 CPU).
    """
    shapes = [(64, 32), (32,), (100, 64)]

    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s)) for s in shapes]

    folded, reference = params(), params()
    fused = torch.optim.AdamW(folded, lr=1e-2, weight_decay=0.1, fused=True)
    foreach = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(6):
        torch.manual_seed(step + 1)
        grads = [torch.randn(s) * 3 * (step + 1) for s in shapes]  # a clip factor that changes by step
        for p, q, g in zip(folded, reference, grads):
            p.grad, q.grad = g.clone(), g.clone()
        norm = clip_and_step(fused, folded, max_norm)
        reference_norm = clip_grad_norm_(reference, max_norm)
        foreach.step()
        assert norm.item() == pytest.approx(reference_norm.item(), rel=1e-6)
        assert not hasattr(fused, "grad_scale")
        for p, q in zip(folded, reference):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    moved = max((p - q).abs().max().item() for p, q in zip(folded, params()))
    assert moved > 1e-3  # the steps did update the parameters
