"""The loss fused into the head (`training.head_loss = "fused"`): numerics, memory, training parity.

`linear_cross_entropy` against the head matmul followed by `F.cross_entropy` (padded vocab
columns masked): in fp32 the loss and both gradients within 1e-5 relative; in bf16 each within
two bf16 epsilons of its largest magnitude of the fp32 reference (the bound
tests/test_kernel_parity.py holds the bf16 kernels to). Training: the tiny model in fp32 with
the fused head follows the separate-head 1-process reference within 1e-5 eagerly (1 and 2
processes, fully_shard) and within 1e-4 compiled (the compile tests' tolerance), with zero graph
breaks and one graph for model + loss under whole-model compile.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.loss import LinearCrossEntropyHead, chunk_loss_and_grad, fuse_loss_into_head, linear_cross_entropy
from tests.test_compile_parity import AC_MODES, STRATEGIES
from tests.test_parallel_parity import COMPILED_TOLERANCE, TOLERANCE, assert_close_runs

FUSED = ["--training.head_loss", "fused"]
DP2 = ["--parallelism.tensor_parallel_degree", "1"]
# Trained in the 2-process launch shared with the parity tests (the `world2` fixture, tests/conftest.py).
HEAD_LOSS_WORLD2 = {
    "fully_shard eager": DP2 + FUSED,
    "fully_shard, blocks compiled": STRATEGIES["blocks"] + DP2 + FUSED,
    "graph engine, whole model compiled, op SAC": STRATEGIES["model"] + DP2 + AC_MODES["sel_op"] + FUSED,
}


def _reference(hidden, weight, labels, num_classes, scale):
    """Loss and gradients of the separate path: logits, then cross-entropy over the real columns."""
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits[..., :num_classes].flatten(0, -2).float(), labels.flatten())
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, labels, num_classes, scale, **kwargs):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = linear_cross_entropy(hidden, weight, labels, num_classes, **kwargs)
    (loss * scale).backward()
    return loss.detach(), hidden.grad, weight.grad


def _inputs(dtype, vocab=96, num_classes=90, dim=32, shape=(3, 50)):
    torch.manual_seed(0)
    hidden = torch.randn(*shape, dim).to(dtype)
    weight = (torch.randn(vocab, dim) * dim ** -0.5).to(dtype)
    labels = torch.randint(0, num_classes, shape)
    return hidden, weight, labels, num_classes


@pytest.mark.parametrize("chunk_rows", [1, 7, 150, 1000])  # one row a chunk, uneven chunks, exactly one, more than all
def test_fp32_matches_head_then_cross_entropy(chunk_rows):
    hidden, weight, labels, num_classes = _inputs(torch.float32)
    expected = _reference(hidden, weight, labels, num_classes, 0.25)
    got = _fused(hidden, weight, labels, num_classes, 0.25, chunk_elements=chunk_rows * weight.shape[0])
    for name, want, have in zip(("loss", "hidden grad", "weight grad"), expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-7, msg=name)
    assert got[2][num_classes:].abs().max() == 0  # padded vocab rows get no gradient


def test_bf16_within_two_bf16_epsilons_of_fp32():
    hidden, weight, labels, num_classes = _inputs(torch.bfloat16)
    expected = _reference(hidden.float(), weight.float(), labels, num_classes, 1.0)
    got = _fused(hidden, weight, labels, num_classes, 1.0, chunk_elements=40 * weight.shape[0])
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    eps = torch.finfo(torch.bfloat16).eps
    for name, want, have in zip(("loss", "hidden grad", "weight grad"), expected, got):
        bound = 2 * eps * want.abs().max().item()
        assert (have.float() - want).abs().max().item() <= bound, name


def test_bf16_weight_gradient_sums_chunks_in_fp32():
    """The weight gradient's chunks are summed in fp32 and rounded to bf16 once, as one matmul
    over all tokens rounds it: 150 one-token chunks give the one-chunk result to within one
    bf16 rounding of each element (a bf16 partial per chunk would add 150 roundings)."""
    hidden, weight, labels, num_classes = _inputs(torch.bfloat16)
    one_chunk = _fused(hidden, weight, labels, num_classes, 1.0, chunk_elements=1000 * weight.shape[0])[2].float()
    per_token = _fused(hidden, weight, labels, num_classes, 1.0, chunk_elements=weight.shape[0])[2].float()
    one_rounding = torch.finfo(torch.bfloat16).eps * one_chunk.abs()
    assert ((per_token - one_chunk).abs() <= one_rounding).all()


def test_compiled_chunk_matches_eager():
    logits = torch.randn(40, 96)
    labels = torch.randint(0, 90, (40,))
    compiled = torch.compile(chunk_loss_and_grad, backend="inductor", dynamic=False)
    for want, have in zip(chunk_loss_and_grad(logits, labels, 90, 0.5), compiled(logits, labels, 90, 0.5)):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-7)


class _LargestVocabTensor(TorchDispatchMode):
    """Largest number of rows of any tensor created (not a view) with the vocabulary as its last dim."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tensor_holds_more_than_one_chunk_of_logits():
    """The separate path holds [tokens, vocab] logits; the fused one never more than a chunk
    (the weight and its gradient, [vocab, dim], are not logits: dim differs from vocab here)."""
    hidden, weight, labels, num_classes = _inputs(torch.float32)
    tokens = labels.numel()
    with _LargestVocabTensor(weight.shape[0]) as separate:
        _reference(hidden, weight, labels, num_classes, 1.0)
    with _LargestVocabTensor(weight.shape[0]) as fused:
        _fused(hidden, weight, labels, num_classes, 1.0, chunk_elements=16 * weight.shape[0])
    assert separate.rows == tokens
    assert fused.rows == 15  # 150 tokens in 10 chunks of 15 rows


def test_fused_head_keeps_exactly_its_two_gradients():
    """What the memory estimate counts as the fused loss's saved bytes is all it keeps for
    backward: not its input, not the bf16 copy of its fp32 weight (dp = 1 casts at use)."""
    from parallel.data_parallel import apply_compute_dtype
    from parallel.memory import loss_bytes, retained_bytes

    tokens, dim, vocab, num_classes = 200, 64, 512, 500
    head = torch.nn.Linear(dim, vocab, bias=False)
    fuse_loss_into_head(head, num_classes)
    apply_compute_dtype(head, torch.bfloat16)
    hidden = torch.randn(tokens, dim, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, num_classes, (tokens,))
    kept = retained_bytes(lambda: head(hidden, labels), exclude=[hidden, labels, *head.parameters()])
    _, saved, _ = loss_bytes(tokens, vocab, num_classes, compute_bytes=2, loss_parallel=False, compiled=False,
                             fused_head=True, head_in_features=dim)
    assert kept == saved == tokens * dim * 2 + vocab * dim * 4  # the weight's gradient summed in fp32


def test_head_keeps_its_linear_behaviour_and_names():
    head = torch.nn.Linear(8, 12, bias=False)
    before = dict(head.state_dict())
    fuse_loss_into_head(head, 10)
    assert isinstance(head, LinearCrossEntropyHead) and list(head.state_dict()) == list(before)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(head(x), F.linear(x, head.weight))
    labels = torch.randint(0, 10, (2, 5))
    torch.testing.assert_close(head(x, labels), F.cross_entropy(F.linear(x, head.weight)[..., :10].flatten(0, 1), labels.flatten()))
    with pytest.raises(TypeError):
        fuse_loss_into_head(torch.nn.Linear(8, 12), 10)  # a bias is not part of the fused formula


def test_one_process_fused_follows_the_separate_head(references):
    assert_close_runs(references[8], references["fused"], "1 process, fused head")


@pytest.mark.parametrize("name", list(HEAD_LOSS_WORLD2))
def test_two_processes_fused_follows_the_separate_head(world2, references, name):
    records = world2[" ".join(HEAD_LOSS_WORLD2[name])]
    assert_close_runs(references[8], records, name, COMPILED_TOLERANCE if "compiled" in name else TOLERANCE)
    if "compiled" in name:
        last = records[-1]
        assert last["graph_breaks"] == 0 and last["recompiles_after_warmup"] == 0, name
        if "whole model" in name:
            assert last["unique_graphs"] == 1, name

