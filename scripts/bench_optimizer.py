"""Time the update step (gradient norm, clipping, AdamW) at a model's real parameter shapes.

The update is memory-bound: AdamW reads the fp32 parameter, gradient and two moments and writes
three of them back, 28 bytes a parameter, and clipping reads and writes the gradient once more.
This script measures each way of running it against the bandwidth a plain copy reaches, so the
choice in `trainer/optim.py` (`clip_and_step`) rests on numbers (results in docs/performance.md):

    python scripts/bench_optimizer.py --flavor 3B

It prints one table (ms per update, GB/s counted as the bytes each variant must move).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import median_ms  # noqa: E402  (scripts/, the running script's folder)
from models.llama3 import padded_vocab_size, flavor_args, Transformer  # noqa: E402
from parallel.grad_clip import clip_grad_norm_, global_norm  # noqa: E402
from trainer.optim import clip_and_step  # noqa: E402
from trainer.triton_adamw import TritonAdamW  # noqa: E402


def _params(flavor: str, device: torch.device) -> list[torch.nn.Parameter]:
    """The flavor's parameters (fp32, random) with random fp32 gradients."""
    args = flavor_args(flavor, vocab_size=padded_vocab_size(128_256), max_seq_len=8192)
    with torch.device("meta"):
        model = Transformer(args)
    params = []
    for p in model.parameters():
        q = torch.nn.Parameter(torch.randn(p.shape, device=device) * 0.02)
        q.grad = torch.randn(p.shape, device=device) * 1e-3
        params.append(q)
    return params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="3B")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    # Large enough that clipping never shrinks the random gradients over the timed calls,
    # while every variant still does the work of clipping.
    parser.add_argument("--max-norm", type=float, default=1e6)
    parser.add_argument("--skip-compiled", action="store_true", help="leave out the compiled row (about a minute to compile)")
    args = parser.parse_args()
    device = torch.device("cuda")
    params = _params(args.flavor, device)
    n = sum(p.numel() for p in params)
    print(f"{args.flavor}: {len(params)} tensors, {n / 1e9:.2f} B parameters, torch {torch.__version__}, {torch.cuda.get_device_name()}")

    big = torch.empty(n, device=device)
    other = torch.empty_like(big)
    copy_ms = median_ms(lambda: other.copy_(big), args.steps, args.warmup)
    del big, other

    def adamw(lr: float | torch.Tensor = 3e-4, **kw) -> torch.optim.AdamW:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)

    def norm_only() -> None:
        clip_grad_norm_(params, 0.0)

    rows = [("copy (bandwidth reference)", copy_ms, 8 * n), ("grad norm only", median_ms(norm_only, args.steps, args.warmup), 4 * n)]

    foreach = adamw(foreach=True)
    try:
        rows.append(("foreach AdamW step only", median_ms(foreach.step, args.steps, args.warmup), 28 * n))
    except torch.OutOfMemoryError:  # its per-step temporaries are a copy of the parameters
        rows.append(("foreach AdamW step only (out of memory)", float("nan"), 28 * n))
    del foreach  # one optimizer's state at a time: two do not fit at 8B
    torch.cuda.empty_cache()

    fused = adamw(fused=True)

    def separate_clip() -> None:
        clip_grad_norm_(params, args.max_norm)
        fused.step()

    def folded_clip() -> None:
        # The kernel writes each divided gradient back: this saves the clip's read, not its write.
        clip_and_step(fused, params, args.max_norm)

    rows += [
        ("fused AdamW step only", median_ms(fused.step, args.steps, args.warmup), 28 * n),
        ("norm + clip + fused step (a separate clip pass)", median_ms(separate_clip, args.steps, args.warmup), 40 * n),
        ("norm + fused step with the clip folded in (what trains)", median_ms(folded_clip, args.steps, args.warmup), 36 * n),
    ]
    del fused
    torch.cuda.empty_cache()

    triton_adamw = TritonAdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    rows += [
        ("Triton AdamW step only", median_ms(triton_adamw.step, args.steps, args.warmup), 28 * n),
        ("norm + Triton step with the clip folded in", median_ms(lambda: clip_and_step(triton_adamw, params, args.max_norm),
                                                             args.steps, args.warmup), 32 * n),
    ]
    # Compact gradients: bf16 gradients read as they are, no widening pass (parallel/compact_gradients.py).
    bf16 = {p: p.grad.to(torch.bfloat16) for p in params}
    for p in params:
        p.grad = None
    triton_adamw.gradient_of = bf16.get
    triton_adamw.grad_scale = torch.ones((), device=device)  # the clip factor, as clip_and_step hands it over
    rows.append(("norm + Triton step, bf16 gradients (compact), clip folded",
                 median_ms(lambda: (global_norm(bf16.values()), triton_adamw.step()), args.steps, args.warmup), 28 * n))
    for p in params:
        p.grad = bf16.pop(p).float()
    del triton_adamw.grad_scale, triton_adamw
    torch.cuda.empty_cache()
    if not args.skip_compiled:
        rows.append(_compiled_row(params, adamw, args))
    print("| variant | ms | GB/s |\n|---|---|---|")
    for name, ms, nbytes in rows:
        print(f"| {name} | {ms:.1f} | {nbytes / ms / 1e6:,.0f} |")


def _compiled_row(params: list[torch.nn.Parameter], adamw, args: argparse.Namespace) -> tuple[str, float, int]:
    """torch.compile of the norm, the clip and a capturable foreach AdamW step."""
    device = params[0].device
    n = sum(p.numel() for p in params)
    compiled = adamw(torch.tensor(3e-4, device=device), foreach=True, capturable=True)

    @torch.compile
    def compiled_step() -> None:
        clip_grad_norm_(params, args.max_norm)
        compiled.step()

    t0 = time.perf_counter()
    compiled_step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    return (f"compiled norm + clip + step ({compile_s:.0f} s compile)", median_ms(compiled_step, args.steps, args.warmup),
            32 * n)


if __name__ == "__main__":
    main()
