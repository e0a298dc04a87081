"""The model's and loss's previous formulas, kept only as references (tests and the loss curve).

Before issue 10 the model computed RoPE in fp32 with stride-2 even/odd access, RMSNorm with
explicit fp32 up/down casts, attention with K/V repeated to the query head count, and the
loss as one fp32 cross-entropy over the whole [tokens, vocab] logits. `tests/test_kernel_parity.py`
checks the current paths against these; `install()` swaps them into the model and loss
modules so that a whole training run can use them (`scripts/benchmark.py --loss-curve`
launches this file in place of train.py for its "old paths" run).

A module rather than a config switch: the product code keeps one path per op, and the old
formulas cannot drift into use by accident.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rope_table(args, device: torch.device | None = None) -> torch.Tensor:
    """cos/sin of every position and frequency, shape [max_seq_len, head_dim // 2, 2], fp32."""
    from models.llama3.model import _scale_rope_freqs

    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    if args.use_scaled_rope:
        freqs = _scale_rope_freqs(freqs, args)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) pairs of x [b, s, h, d] in fp32."""
    seqlen = x.shape[1]
    cos = table[:seqlen, :, 0].view(1, seqlen, 1, -1)
    sin = table[:seqlen, :, 1].view(1, seqlen, 1, -1)
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def rms_norm_forward(self, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm.forward with explicit fp32 casts of input and weight."""
    return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [b, h, s, d] after repeating k, v [b, h_kv, s, d] to h heads."""
    repeats = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, num_classes: int, kernels=None, *,
                       overwrite_logits: bool = False) -> torch.Tensor:
    """Mean fp32 cross-entropy of the whole logits, padded columns masked to -inf (vocab-sharded
    DTensor logits under `loss_parallel()`). This formula is still what parallel/loss.py runs
    under torch.compile, so the reference is that function. Takes the current signature and
    ignores what the old path did not have (the passes' kernels, writing over the logits)."""
    from parallel.loss import _fused_by_compiler

    return _fused_by_compiler(logits, labels, num_classes)


def patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, old formula) for every path issue 10 changed."""
    import models.llama3.model as model
    import parallel.loss as loss

    return [
        (model, "rope_table", rope_table),
        (model, "apply_rope", apply_rope),
        (model, "causal_attention", causal_attention),
        (model.RMSNorm, "forward", rms_norm_forward),
        (loss, "cross_entropy_loss", cross_entropy_loss),
    ]


def install() -> None:
    """Make the model and the loss use the formulas above (before the trainer is imported)."""
    for owner, name, value in patches():
        setattr(owner, name, value)


if __name__ == "__main__":
    # `torchrun tests/reference_paths.py --job.config_file X.toml ...`: train.py on the old paths.
    sys.path.insert(0, ROOT)
    install()
    from trainer.main import main

    sys.exit(main(sys.argv[1:]))
