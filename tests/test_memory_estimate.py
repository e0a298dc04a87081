"""The activation count of a Llama 3 block (models/llama3/memory.py) against a real block on CPU.

Eager, one process: every storage the forward leaves alive, per checkpointing kind, equals the
count byte for byte. Tensor parallel (tp 2, sequence parallel on and off) is checked the same
way in tests/test_planner_gloo.py; the compiled counts by scripts/measure_activations.py
(compiling takes minutes on CPU; docs/planning.md has its output).
"""

import pytest
import torch

import parallel.loss as loss_module
import parallel.memory as memory
from models.llama3.args import ModelArgs
from models.llama3.memory import check_block
from models.llama3.model import TransformerBlock

# Llama's shape at a small size: grouped-query attention with 128-wide heads, SwiGLU at 8/3 x dim.
ARGS = ModelArgs(dim=384, n_layers=1, n_heads=3, n_kv_heads=1, ffn_dim_multiplier=1.0, multiple_of=256,
                 vocab_size=512, max_seq_len=512)


@pytest.mark.parametrize("kind", ["none", "full", "op", "op_all"])
def test_eager_block_keeps_what_the_count_says(kind):
    measured, counted = check_block(ARGS, kind, 256)
    assert measured == counted


@pytest.mark.parametrize("kind", ["none", "full", "op"])
def test_cast_copies_kept_only_outside_checkpointing(kind):
    """fp32 weights cast to bf16 at use (dp = 1): without checkpointing autograd keeps every
    cast copy (the matmuls' and the norms' backward read the weights); a checkpointed block
    recomputes the casts and keeps none, which the estimate counts as zero."""
    measured, counted = check_block(ARGS, kind, 256, cast_at_use=True)
    assert measured == counted
    plain_measured, _ = check_block(ARGS, kind, 256)
    weights = sum(p.numel() for p in TransformerBlock(0, ARGS).parameters()) * 2
    assert measured - plain_measured == (weights if kind == "none" else 0)


def test_eager_separate_loss_holds_what_the_count_says(monkeypatch):
    """parallel/loss.py's eager cross-entropy on bf16 logits an op made (as a head's are):
    its forward's working set, what it keeps for backward and its backward's working set
    against `loss_bytes`, each beside the logits. Within 16 bytes a token: the count leaves
    out per-token integer temporaries and rounds a chunk up to CHUNK_ELEMENTS."""
    tokens, columns, real = 512, 1000, 990
    for module in (loss_module, memory):
        monkeypatch.setattr(module, "CHUNK_ELEMENTS", 64 * columns)
    x = torch.randn(1, tokens, columns).bfloat16().requires_grad_()
    labels = torch.randint(0, real, (1, tokens))
    for overwrites in (True, False):
        forward, saved, backward = (n - tokens * columns * 2 for n in memory.loss_bytes(
            tokens, columns, real, compute_bytes=2, loss_parallel=False, compiled=False, overwrites=overwrites))
        logits = x * 1

        def loss():
            return loss_module.cross_entropy_loss(logits, labels, real, overwrite_logits=overwrites)

        out = {}
        measured_forward = memory.peak_new_bytes(lambda: out.update(loss=loss()))
        measured_saved = memory.retained_bytes(loss, exclude=[logits])
        measured_backward = memory.peak_new_bytes(lambda: torch.autograd.grad(out["loss"], logits))
        for name, measured, counted in (("forward", measured_forward, forward), ("saved", measured_saved, saved),
                                        ("backward", measured_backward, backward)):
            assert abs(measured - counted) <= 16 * tokens, (overwrites, name, measured, counted)
        # overwriting: a chunk, not a second [tokens, vocab]
        assert backward > 0 and (measured_backward < tokens * columns * 2) == overwrites


def test_head_backward_makes_what_the_count_says():
    """A cast-at-use head (fp32 weight, bf16 copy): the backward from the logits' gradient to
    the head's input and bf16 weight copy creates exactly `head_gradient_bytes`, no fp32 temp."""
    tokens, columns, dim = 256, 1000, 384
    h = torch.randn(tokens, dim).bfloat16().requires_grad_()
    weight = torch.randn(columns, dim, requires_grad=True)
    copy = weight.bfloat16()
    logits = torch.nn.functional.linear(h, copy)
    grad = torch.randn_like(logits)
    measured = memory.peak_new_bytes(lambda: torch.autograd.grad(logits, [h, copy], grad))
    assert measured == memory.head_gradient_bytes(tokens, columns, dim, compute_bytes=2, weight=True)
