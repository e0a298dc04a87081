"""Cross-entropy over padded vocabularies, for replicated or vocab-sharded (loss-parallel) logits.

The logits are [tokens, vocab] in the compute dtype (bf16 on GPU: 4 GiB at Llama 3 3B, seq
8192, local batch 2). Run eagerly, `F.cross_entropy(logits.float())` writes an fp32 copy,
saves an fp32 log-softmax for backward and builds two fp32 gradients in backward: about 23 GiB
at that size, at the step's memory peak. This module instead makes two passes over the
logits: forward computes and saves only the per-token log-sum-exp; backward rebuilds the
softmax from the saved logits and writes the gradient in the logits' dtype, over the logits
themselves. Each pass runs eagerly in fp32 chunks of the tokens, or as one inductor kernel
(`compiled_kernels`); the peak is then the bf16 logits alone. Inside a whole-model compile
the single-expression formula is traced with the model instead, and inductor fuses it.
"""

from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# fp32 elements of one chunk: 512 MiB, about 1,000 tokens of a 128k vocabulary.
CHUNK_ELEMENTS = 1 << 27

# training.head_loss: "separate" runs the head, then `cross_entropy_loss` on its logits;
# "fused" computes the loss inside the head, chunk by chunk (`fuse_loss_into_head`): less
# memory, slower (docs/performance.md), so not the default.
HEAD_LOSS_MODES = ("separate", "fused")


class CrossEntropyKernels(NamedTuple):
    """The two passes over the logits that `cross_entropy_loss` makes, on one shard's plain
    tensor local [tokens, columns] whose first `real` > 0 columns are classes (the rest vocab
    padding); a label outside [vocab_start, vocab_start + real) lives in another shard.

    stats(local, labels, vocab_start, real) -> (lse, target): per token, in fp32, the
        log-sum-exp over the real columns and the label's logit (0 where it lives elsewhere).
    gradient_(local, labels, lse, scale, vocab_start, real): overwrite local with
        scale x (softmax - one-hot), and 0 in the padding columns; `scale` is a 0-dim tensor.
    """

    stats: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]
    gradient_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int], None]


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_classes: int, kernels: CrossEntropyKernels | None = None,
    *, overwrite_logits: bool = False,
) -> torch.Tensor:
    """Mean token cross-entropy in fp32 of logits [batch, seq, vocab] and labels [batch, seq].

    Logit columns >= `num_classes` (vocab padding rows of the head) take no probability mass
    and get zero gradient. With loss parallel the logits are a DTensor sharded on the vocab
    dim; it must then run under `torch.distributed.tensor.parallel.loss_parallel()`, and the
    full logits are never gathered. The result is the same on every rank of the vocab shards.

    With `overwrite_logits`, for a caller that owns the logits and reads nothing of them after
    the loss (the trainer), backward writes the logits' gradient into the logits' own storage
    when they are an intermediate of the autograd graph (a head's output): one [tokens, vocab]
    buffer at the loss's backward instead of two (4 GiB less at Llama 3 3B, seq 8192, local
    batch 2). Their version counter is bumped (the DTensor's too, under loss parallel), so an
    autograd node that saved them fails autograd's version check instead of reading a gradient,
    and so does a second backward through a retained graph. Logits that are a leaf or a view
    (of a leaf, a parameter, a DTensor's local shard, ...) are never overwritten.

    `kernels` runs the two passes over the logits: `EAGER_KERNELS` (the default) walks them
    in chunks, `compiled_kernels(backend)` has inductor fuse each pass into one kernel. Under
    an enclosing torch.compile (the model and loss as one graph) neither is used: the
    single-expression formula is traced with the model.
    """
    mesh = None
    if isinstance(logits, DTensor):
        if logits.placements != (Shard(logits.ndim - 1),) and logits.placements != (Shard(-1),):
            raise ValueError(f"loss parallel expects logits sharded on the vocab dim, got {logits.placements}")
        mesh = logits.device_mesh
    if torch.compiler.is_compiling():
        return _fused_by_compiler(logits, labels, num_classes)
    kernels = kernels or EAGER_KERNELS
    # an op's own output, not a view
    overwritten = logits if overwrite_logits and logits.grad_fn is not None and logits._base is None else None
    if mesh is None:
        local, vocab_start = logits, 0
    else:
        local = logits.to_local()
        vocab_start = mesh.get_local_rank() * local.shape[-1]
    local, labels = local.flatten(0, 1), labels.flatten()
    real = _real_columns(local, vocab_start, num_classes)
    with torch.no_grad():
        if real > 0:
            lse, target = kernels.stats(local, labels, vocab_start, real)
        else:  # a shard of padding only
            lse = torch.full(labels.shape, float("-inf"), dtype=torch.float32, device=local.device)
            target = torch.zeros(labels.shape, dtype=torch.float32, device=local.device)
        if mesh is not None:
            lse, target = _combine_vocab_shards(lse, target, mesh)
    return _CrossEntropyFromStats.apply(local, labels, lse, target, vocab_start, real, kernels, overwritten)


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
    local: torch.Tensor, labels: torch.Tensor, vocab_start: int, real: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`CrossEntropyKernels.stats`, one fp32 chunk of CHUNK_ELEMENTS at a time."""
    tokens = local.shape[0]
    lse = torch.empty((tokens,), dtype=torch.float32, device=local.device)
    target = torch.empty((tokens,), dtype=torch.float32, device=local.device)
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


def _chunked_gradient_(
    local: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int, real: int
) -> None:
    """`CrossEntropyKernels.gradient_`, one fp32 chunk at a time: each chunk's softmax is
    built from the chunk before it is overwritten."""
    local[:, real:] = 0
    index, here = _local_targets(labels, vocab_start, real)
    rows = _chunk_rows(real)
    for start in range(0, local.shape[0], rows):
        stop = min(start + rows, local.shape[0])
        p = (local[start:stop, :real] - lse[start:stop, None]).exp_()  # softmax, fp32
        p.scatter_add_(1, index[start:stop, None], -here[start:stop, None].float())
        torch.mul(p, scale, out=local[start:stop, :real])  # scale and downcast
        del p  # before the next chunk's: one fp32 chunk alive, not two


def _whole_stats(
    local: torch.Tensor, labels: torch.Tensor, vocab_start: int, real: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`CrossEntropyKernels.stats` as one expression, for inductor: it reads the logits in
    their dtype and never stores an fp32 copy."""
    x = local[:, :real].float()
    index, here = _local_targets(labels, vocab_start, real)
    target = torch.where(here, x.gather(1, index[:, None]).squeeze(1), 0.0)
    return torch.logsumexp(x, dim=-1), target


def _whole_gradient_(
    local: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, vocab_start: int, real: int
) -> None:
    """`CrossEntropyKernels.gradient_` as one expression, for inductor, which writes the
    result straight into `local`'s storage: one pointwise kernel, no temporary."""
    index, here = _local_targets(labels, vocab_start, real)
    column = torch.arange(local.shape[-1], device=local.device)
    p = torch.where(column < real, (local.float() - lse[:, None]).exp(), 0.0)
    p = p - ((column == index[:, None]) & here[:, None]).float()
    local.copy_(p * scale)


EAGER_KERNELS = CrossEntropyKernels(_chunked_stats, _chunked_gradient_)


def compiled_kernels(backend: str | Callable = "inductor") -> CrossEntropyKernels:
    """`CrossEntropyKernels` compiled with `backend`: each pass one fused kernel, shapes static.

    Compiled lazily, on the first call; `vocab_start` and `real` are constants of the graph
    (a rank's shard keeps them for the whole run)."""
    return CrossEntropyKernels(
        torch.compile(_whole_stats, backend=backend, fullgraph=True, dynamic=False),
        torch.compile(_whole_gradient_, backend=backend, fullgraph=True, dynamic=False),
    )


def _combine_vocab_shards(
    lse: torch.Tensor, target: torch.Tensor, mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global per-token log-sum-exp and label logit from every vocab shard's, in one
    all-gather; every rank computes the same values from the same gathered tensor."""
    stats = torch.stack([lse, target])[None]
    gathered = DTensor.from_local(stats, mesh, [Shard(0)], run_check=False).full_tensor()
    return torch.logsumexp(gathered[:, 0], dim=0), gathered[:, 1].sum(dim=0)


class _CrossEntropyFromStats(torch.autograd.Function):
    """mean(lse - target) whose backward rebuilds softmax from the saved logits and the
    per-token lse, writing d loss / d logits in the logits' dtype: into the logits themselves
    when `overwritten` (the logits, a DTensor under loss parallel, whose `local` it is), else
    into a new buffer."""

    @staticmethod
    def forward(ctx, local, labels, lse, target, vocab_start: int, real: int, kernels, overwritten):
        ctx.save_for_backward(local, labels, lse)
        ctx.vocab_start, ctx.real, ctx.kernels = vocab_start, real, kernels
        # A weak reference: the logits' storage is saved above; this only names whose version to bump.
        ctx.overwritten = None if overwritten is None else weakref.ref(overwritten)
        return (lse - target).mean()

    @staticmethod
    def backward(ctx, grad_loss):
        local, labels, lse = ctx.saved_tensors
        grad = local if ctx.overwritten is not None else local.clone()
        if ctx.real == 0:
            grad.zero_()
        else:
            ctx.kernels.gradient_(grad, labels, lse, grad_loss / local.shape[0], ctx.vocab_start, ctx.real)
        overwritten = ctx.overwritten() if ctx.overwritten is not None else None
        if overwritten is not None and overwritten is not local:
            # Writing into a DTensor's local shard does not advance the DTensor's own counter.
            torch.autograd.graph.increment_version(overwritten)
        return grad, None, None, None, None, None, None, None


def chunk_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, num_classes: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of one chunk of logits [rows, vocab], and `scale` x its gradient.

    fp32 inside, the gradient in the logits' dtype; columns >= `num_classes` (vocab padding)
    take no probability mass and get zero gradient. Eagerly one fp32 chunk-sized buffer is
    updated in place (as `_chunked_stats` and `_CrossEntropyFromStats` do); compiled, inductor
    fuses it into a reduction and a pointwise kernel.
    """
    real = min(num_classes, logits.shape[-1])
    x = logits[:, :real]
    peak = x.amax(dim=-1).float()
    p = x - peak[:, None]  # fp32: reads x in its own dtype
    p.exp_()
    total = p.sum(dim=-1)
    loss = (peak + total.log() - x.gather(1, labels[:, None]).squeeze(1).float()).sum()
    p.mul_((scale / total)[:, None])
    p.scatter_add_(1, labels[:, None], torch.full_like(peak[:, None], -scale))
    grad = torch.zeros_like(logits)
    grad[:, :real] = p
    return loss, grad


ChunkLossAndGrad = Callable[[torch.Tensor, torch.Tensor, int, float], tuple[torch.Tensor, torch.Tensor]]


def _add_weight_gradient_(grad_weight: torch.Tensor, grad_logits: torch.Tensor, rows: torch.Tensor) -> None:
    """grad_weight (fp32) += grad_logits.T @ rows, with no rounding to the inputs' dtype between chunks.

    On CUDA with bf16/fp16 inputs one GEMM adds into the fp32 buffer in its epilogue (`addmm`'s
    `out_dtype`, CUDA only, torch >= 2.8). Against a partial product in bf16 added into the
    buffer, measured on an H100 at the 3B head's shape: a 1,024-token chunk's product within
    1.5e-6 of an fp64 reference instead of 2.4e-3 (relative to its largest element), and the
    fused head's forward + backward in 80 ms instead of 93 (docs/performance.md).
    On a CPU the inputs are widened to fp32, which multiplies the same values exactly.
    Traced by torch.compile the partial product stays in the inputs' dtype: dynamo cannot run
    `addmm` with both `out_dtype` and `out=` on fake tensors (torch 2.11, CUDA).
    """
    if torch.compiler.is_compiling():
        grad_weight += grad_logits.t() @ rows
    elif grad_weight.is_cuda and grad_logits.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(grad_weight, grad_logits.t(), rows, out_dtype=torch.float32, out=grad_weight)
    else:
        grad_weight.addmm_(grad_logits.t().to(grad_weight.dtype), rows.to(grad_weight.dtype))


class _LinearCrossEntropy(torch.autograd.Function):
    """mean CE(hidden @ weight.T, labels) with both gradients computed in forward, chunk by chunk.

    The head's backward needs only d loss / d logits, which the forward can compute as soon
    as a chunk's logits exist, so no [tokens, vocab] tensor outlives its chunk: forward keeps
    d loss / d hidden [tokens, dim] and d loss / d weight [vocab, dim], and backward only
    scales them by the incoming gradient. Same matmuls and FLOPs as logits -> loss -> backward.

    The weight's gradient is summed over the chunks in fp32 and kept in fp32 until backward,
    which rounds it to the weight's dtype once, as a one-piece matmul would: rounding it at
    the end of forward would hold the fp32 sum and its rounded copy together there, where
    the saved activations make the step's memory peak.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, num_classes: int, chunk_rows: int, loss_and_grad: ChunkLossAndGrad):
        tokens = hidden.shape[0]
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, tokens, chunk_rows):
            rows = hidden[start:start + chunk_rows]
            chunk_loss, grad_logits = loss_and_grad(rows @ weight.t(), labels[start:start + chunk_rows], num_classes, 1.0 / tokens)
            loss += chunk_loss
            torch.mm(grad_logits, weight, out=grad_hidden[start:start + chunk_rows])
            _add_weight_gradient_(grad_weight, grad_logits, rows)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss / tokens

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # In place: these buffers are this call's own, and a second backward through the same
        # graph is refused by autograd anyway (the saved tensors are freed after the first).
        return grad_hidden.mul_(grad_loss), grad_weight.mul_(grad_loss).to(ctx.weight_dtype), None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    *,
    loss_and_grad: ChunkLossAndGrad = chunk_loss_and_grad,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Mean token cross-entropy of the logits `hidden @ weight.T`, never holding more than one
    chunk of them (about `chunk_elements` fp32 values).

    hidden [..., dim] and labels [...] in any leading shape; weight [vocab, dim] (vocab may be
    padded past `num_classes`). Plain tensors only: a vocab-sharded head (loss parallel) keeps
    `cross_entropy_loss` on its logits. `loss_and_grad` is `chunk_loss_and_grad`, possibly
    compiled.
    """
    hidden, labels = hidden.flatten(0, -2), labels.flatten()
    chunk_rows = fused_chunk_rows(hidden.shape[0], weight.shape[0], chunk_elements)
    return _LinearCrossEntropy.apply(hidden, weight, labels, num_classes, chunk_rows, loss_and_grad)


def fused_chunk_rows(tokens: int, columns: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per chunk of `linear_cross_entropy`: the fewest chunks of at most `chunk_elements`
    logits, made as even as they can be (at most two shapes to compile)."""
    chunks = -(-tokens // max(1, chunk_elements // columns))
    return -(-tokens // chunks)


class LinearCrossEntropyHead(nn.Linear):
    """An output projection that, given labels, returns the loss of its logits instead of them.

    Installed on a model's head by `fuse_loss_into_head` (same parameters and names, so
    checkpoints, FSDP2 units and parameter views are unchanged); without labels it is the
    `nn.Linear` it was. Running the loss inside the head's own forward keeps whatever
    data-parallel hooks the head has (FSDP2 gathers its weight around this forward).
    """

    num_classes: int
    loss_and_grad: ChunkLossAndGrad

    def forward(self, input: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(input)
        return linear_cross_entropy(input, self.weight, labels, self.num_classes, loss_and_grad=self.loss_and_grad)


def fuse_loss_into_head(head: nn.Linear, num_classes: int, loss_and_grad: ChunkLossAndGrad = chunk_loss_and_grad) -> None:
    """Make `head` (a bias-free `nn.Linear`, before any parallel wrapper) a `LinearCrossEntropyHead`."""
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(f"the loss fuses into a bias-free nn.Linear head, got {type(head).__name__}")
    head.__class__ = LinearCrossEntropyHead
    head.num_classes = num_classes
    head.loss_and_grad = loss_and_grad
