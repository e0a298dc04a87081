"""Cross-entropy over padded vocabularies, for replicated or vocab-sharded (loss-parallel) logits.

The logits are [tokens, vocab] in the compute dtype (bf16 on GPU: 4 GiB at Llama 3 3B, seq
8192, local batch 2). Run eagerly, `F.cross_entropy(logits.float())` writes an fp32 copy,
saves an fp32 log-softmax for backward and builds two fp32 gradients in backward: about 23 GiB
at that size, at the step's memory peak. Eagerly this module instead walks the tokens in
chunks: forward keeps one fp32 chunk at a time and saves only the per-token log-sum-exp;
backward rebuilds each chunk's softmax from the saved logits and writes the gradient in
the logits' dtype. Under torch.compile the single-expression formula is kept: inductor fuses
the upcast, log-softmax and loss into reductions that never store fp32 [tokens, vocab], and
its backward into one pointwise kernel, which is what the chunks do by hand.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# fp32 elements of one chunk: 512 MiB, about 1,000 tokens of a 128k vocabulary.
CHUNK_ELEMENTS = 1 << 27


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Mean token cross-entropy in fp32 of logits [batch, seq, vocab] and labels [batch, seq].

    Logit columns >= `num_classes` (vocab padding rows of the head) take no probability mass
    and get zero gradient. With loss parallel the logits are a DTensor sharded on the vocab
    dim; it must then run under `torch.distributed.tensor.parallel.loss_parallel()`, and the
    full logits are never gathered. The result is the same on every rank of the vocab shards.
    """
    mesh = None
    if isinstance(logits, DTensor):
        if logits.placements != (Shard(logits.ndim - 1),) and logits.placements != (Shard(-1),):
            raise ValueError(f"loss parallel expects logits sharded on the vocab dim, got {logits.placements}")
        mesh = logits.device_mesh
    if torch.compiler.is_compiling():
        return _fused_by_compiler(logits, labels, num_classes)
    if mesh is None:
        local, vocab_start = logits, 0
    else:
        local = logits.to_local()
        vocab_start = mesh.get_local_rank() * local.shape[-1]
    local, labels = local.flatten(0, 1), labels.flatten()
    with torch.no_grad():
        lse, target = _chunked_stats(local, labels, vocab_start, num_classes)
        if mesh is not None:
            lse, target = _combine_vocab_shards(lse, target, mesh)
    return _CrossEntropyFromStats.apply(local, labels, lse, target, vocab_start, num_classes)


def _fused_by_compiler(logits: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """The whole-tensor formula, for inductor to fuse (see the module docstring)."""
    vocab = logits.shape[-1]
    if isinstance(logits, DTensor):
        if num_classes < vocab:
            local = logits.to_local()
            start = logits.device_mesh.get_local_rank() * local.shape[-1]
            column = torch.arange(start, start + local.shape[-1], device=local.device)
            local = local.masked_fill(column >= num_classes, float("-inf"))
            logits = DTensor.from_local(local, logits.device_mesh, logits.placements, run_check=False)
    elif num_classes < vocab:
        logits = logits[..., :num_classes]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _chunk_rows(columns: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(columns, 1))


def _real_columns(local: torch.Tensor, vocab_start: int, num_classes: int) -> int:
    """How many of this shard's columns are real classes (the rest is vocab padding)."""
    return min(max(num_classes - vocab_start, 0), local.shape[-1])


def _local_targets(labels: torch.Tensor, vocab_start: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column in this shard (0 where the label lives in another shard), and
    whether it lives in this shard."""
    index = labels - vocab_start
    here = (index >= 0) & (index < columns)
    return torch.where(here, index, 0), here


def _chunked_stats(
    local: torch.Tensor, labels: torch.Tensor, vocab_start: int, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, in fp32: log-sum-exp over this shard's real columns (-inf if it has none)
    and the label's logit (0 where the label is in another shard)."""
    tokens = local.shape[0]
    real = _real_columns(local, vocab_start, num_classes)
    lse = torch.full((tokens,), float("-inf"), dtype=torch.float32, device=local.device)
    target = torch.zeros((tokens,), dtype=torch.float32, device=local.device)
    if real == 0:
        return lse, target
    index, here = _local_targets(labels, vocab_start, real)
    rows = _chunk_rows(real)
    for start in range(0, tokens, rows):
        stop = min(start + rows, tokens)
        x = local[start:stop, :real]
        peak = x.amax(dim=-1).float()
        # x - peak reads x in its own dtype and writes fp32: no separate upcast pass.
        lse[start:stop] = peak + (x - peak[:, None]).exp_().sum(dim=-1).log_()
        picked = x.gather(1, index[start:stop, None]).squeeze(1).float()
        target[start:stop] = torch.where(here[start:stop], picked, 0.0)
    return lse, target


def _combine_vocab_shards(
    lse: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-token log-sum-exp and label logit from every vocab shard's, in one
    all-gather; every rank computes the same values from the same gathered tensor."""
    stats = torch.stack([lse, target])[None]
    gathered = DTensor.from_local(stats, mesh, [Shard(0)], run_check=False).full_tensor()
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


class _CrossEntropyFromStats(torch.autograd.Function):
    """mean(lse - target) whose backward rebuilds softmax chunk by chunk from the saved
    logits and the per-token lse, writing d loss / d logits in the logits' dtype."""

    @staticmethod
    def forward(ctx, local, labels, lse, target, vocab_start: int, num_classes: int):
        ctx.save_for_backward(local, labels, lse)
        ctx.vocab_start, ctx.num_classes = vocab_start, num_classes
        return (lse - target).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        local, labels, lse = ctx.saved_tensors
        tokens = local.shape[0]
        real = _real_columns(local, ctx.vocab_start, ctx.num_classes)
        grad = torch.empty_like(local)
        if real < local.shape[-1]:
            grad[:, real:] = 0
        if real > 0:
            index, here = _local_targets(labels, ctx.vocab_start, real)
            rows = _chunk_rows(real)
            for start in range(0, tokens, rows):
                stop = min(start + rows, tokens)
                p = (local[start:stop, :real] - lse[start:stop, None]).exp_()  # softmax, fp32
                p.scatter_add_(1, index[start:stop, None], -here[start:stop, None].float())
                torch.mul(p, grad_loss / tokens, out=grad[start:stop, :real])  # scale and downcast
        return grad, None, None, None, None, None
