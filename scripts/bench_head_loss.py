"""Time the output projection and its loss, forward and backward, separate and fused into the head.

`training.head_loss = "fused"` (parallel/loss.py's `linear_cross_entropy`) never holds the
[tokens, vocab] logits, but it runs the head's three matmuls chunk by chunk over the tokens and
accumulates the weight's gradient across chunks. This script measures what that costs against
the separate path the trainer runs by default (one head matmul, `cross_entropy_loss` with its
compiled passes writing the gradient over the logits, autograd's two gradient matmuls), at a
flavor's real head shape and several chunk sizes, so the choice of chunk size rests on numbers
(results in docs/performance.md):

    python scripts/bench_head_loss.py --flavor 3B --tokens 16384

It prints one table: ms per forward + backward, the memory it adds at its peak over the
inputs, and each path's loss and gradients against the separate path's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import median_ms  # noqa: E402  (scripts/, the running script's folder)
from models.llama3 import flavor_args, padded_vocab_size  # noqa: E402
from parallel.loss import (  # noqa: E402
    chunk_loss_and_grad, compiled_kernels, cross_entropy_loss, fused_chunk_rows, linear_cross_entropy,
)

N_WORDS = 128_256  # Llama 3's tokenizer


def _peak_added_mib(fn: Callable[[], None]) -> float:
    """MiB that one call of `fn` allocates at its peak above what was allocated before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="3B")
    parser.add_argument("--tokens", type=int, default=16_384, help="tokens per micro-batch (local batch x seq)")
    parser.add_argument("--chunk-elements", default="27,28,29,30", help="log2 of the fused path's chunk sizes")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    model_args = flavor_args(args.flavor, vocab_size=padded_vocab_size(N_WORDS), max_seq_len=8192)
    vocab, dim = model_args.vocab_size, model_args.dim
    print(f"{args.flavor} head: [{vocab}, {dim}], {args.tokens} tokens, torch {torch.__version__}, {torch.cuda.get_device_name()}")

    torch.manual_seed(0)
    hidden = (torch.randn(args.tokens, dim, device=device) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(vocab, dim, device=device) * dim**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, N_WORDS, (args.tokens,), device=device)
    kernels = compiled_kernels()
    chunk_fn = torch.compile(chunk_loss_and_grad, dynamic=False)

    def separate() -> torch.Tensor:
        logits = F.linear(hidden.unsqueeze(0), weight)  # an op's output, not a view: its gradient overwrites it
        return cross_entropy_loss(logits, labels.unsqueeze(0), N_WORDS, kernels, overwrite_logits=True)

    def fused(chunk_elements: int) -> Callable[[], torch.Tensor]:
        return lambda: linear_cross_entropy(hidden, weight, labels, N_WORDS, loss_and_grad=chunk_fn, chunk_elements=chunk_elements)

    def results(loss_fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor, torch.Tensor]:
        hidden.grad = weight.grad = None
        loss = loss_fn()
        loss.backward()
        return loss.item(), hidden.grad.float(), weight.grad.float()

    reference = results(separate)
    paths = [("separate (head, then loss)", separate)]
    paths += [(f"fused, chunks of 2^{e} elements ({fused_chunk_rows(args.tokens, vocab, 1 << e)} tokens)", fused(1 << e))
              for e in map(int, args.chunk_elements.split(","))]
    print("| path | ms | peak added MiB | loss diff | hidden grad max rel diff | weight grad max rel diff |\n|---|---|---|---|---|---|")
    for name, loss_fn in paths:
        loss, grad_hidden, grad_weight = results(loss_fn)

        def step() -> None:
            hidden.grad = weight.grad = None
            loss_fn().backward()

        ms = median_ms(step, args.steps, args.warmup)
        hidden.grad = weight.grad = None
        peak = _peak_added_mib(step)
        rel_h = ((grad_hidden - reference[1]).abs().max() / reference[1].abs().max()).item()
        rel_w = ((grad_weight - reference[2]).abs().max() / reference[2].abs().max()).item()
        print(f"| {name} | {ms:.1f} | {peak:,.0f} | {abs(loss - reference[0]):.2e} | {rel_h:.2e} | {rel_w:.2e} |", flush=True)


if __name__ == "__main__":
    main()
