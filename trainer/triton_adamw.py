"""AdamW with one Triton kernel per parameter, which never writes a gradient back.

Why: the AdamW step is memory-bound (fp32 parameter, gradient and two moments read, three
written: 28 bytes a parameter) and torch's fused AdamW moves those bytes at 3.4 TB/s on an
H200, where a plain copy reaches 4.3 TB/s (scripts/bench_optimizer.py, docs/performance.md).
With a clip factor (`grad_scale`, trainer/optim.py) the fused kernel also writes every
divided gradient back, 4 bytes a parameter more that nothing reads. This kernel is one
elementwise pass per parameter that reads the gradient in whatever dtype it was made in,
divides it by the clip factor in registers, and writes only the parameter and the moments
(and, where asked, the parameter's compute-dtype copy that forward reads, in the same pass).

It is `torch.optim.AdamW` in everything but the step: the same param groups, hyper-parameters
and per-parameter state (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints move between it and
the fused, foreach and for-loop implementations. The update is AdamW's (decoupled weight
decay, bias-corrected moments, `eps` added after the square root) in fp32; it differs from
torch's kernels by rounding only (tests/test_triton_adamw.py, in Triton's interpreter on a
CPU). `amsgrad`, `maximize` and complex parameters are not supported; the trainer uses none.
The kernel walks a parameter, its gradient and moments as flat memory at the same offsets, so
a parameter must fill its memory (contiguous, or its dims permuted; FSDP2 and tensor-parallel
shards are contiguous), and a gradient or loaded moment laid out otherwise is copied into the
parameter's layout first.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

# Elements per program: 4,096 fp32 elements of four tensors is 64 KiB read per program, enough
# to keep an H200's memory system busy with 8 warps.
BLOCK = 4096


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (triton is imported only here: CPU-only
    installs may lack it, and `TRITON_INTERPRET=1` must be set before this first call to run
    it in Triton's interpreter)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(
        param, grad, exp_avg, exp_avg_sq, grad_divisor, numel,
        beta1, beta2, eps, lr_weight_decay, step_size, bias_correction2_sqrt, copy,
        BLOCK: tl.constexpr, WRITES_COPY: tl.constexpr,
    ):
        # The order of torch's fused kernel (ATen's fused_adam_utils.cuh), with IEEE-rounded
        # division and square root as nvcc compiles them there (Triton's `/` and `tl.sqrt`
        # are approximate).
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        g = tl.div_rn(tl.load(grad + offsets, mask=mask).to(tl.float32), tl.load(grad_divisor))
        p = tl.load(param + offsets, mask=mask)
        m = tl.load(exp_avg + offsets, mask=mask)
        v = tl.load(exp_avg_sq + offsets, mask=mask)
        p = p - lr_weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(param + offsets, p, mask=mask)
        tl.store(exp_avg + offsets, m, mask=mask)
        tl.store(exp_avg_sq + offsets, v, mask=mask)
        if WRITES_COPY:
            # The bf16 copy forward reads, rounded to nearest even on the bits as torch's
            # `Tensor.to` rounds (a NaN stays a NaN, its payload aside). Spelled out rather than
            # `.to(tl.bfloat16)`, which Triton's interpreter truncates: so the CPU tests check
            # the rounding the GPU runs.
            bits = p.to(tl.uint32, bitcast=True)
            upper = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
            upper = tl.where(p != p, 0x7FC0, upper).to(tl.uint16)
            tl.store(copy + offsets, upper.to(tl.bfloat16, bitcast=True), mask=mask)

    return triton.cdiv, adamw_kernel


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its memory without gaps or overlaps, in some order of its dims
    (contiguous, or e.g. transposed): then an elementwise update can walk that memory flat."""
    order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
    return t.permute(order).is_contiguous()


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the same element sits at the same offset in `a` and `b` (a size-1 dim's stride is
    never used)."""
    return all(a.stride(d) == b.stride(d) for d in range(a.dim()) if a.size(d) > 1)


def _laid_out_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it with `like`'s strides: the kernel reads every tensor of a parameter
    at the same flat offsets."""
    if _same_layout(t, like):
        return t
    return torch.empty_strided(like.shape, like.stride(), dtype=t.dtype, device=t.device).copy_(t)


class TritonAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose step is one Triton launch per parameter.

    `grad_scale`, when set (a one-element tensor), divides every gradient as it is read: the
    hand-off `torch.amp.GradScaler` uses for fused optimizers, which `clip_and_step` uses for
    the clip factor. `gradient_of(param)` says where a parameter's gradient is; by default its
    `.grad`, whatever its dtype. `copy_of(param)` names a bf16 tensor laid out as the parameter
    that the step writes with the updated value rounded to bf16 (a compute-dtype weight copy,
    parallel/compact_gradients.py), or None; by default None.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **hyperparameters) -> None:
        super().__init__(params, foreach=False, fused=False, **hyperparameters)
        if self.defaults["amsgrad"] or self.defaults["maximize"]:
            raise ValueError("the Triton AdamW supports neither amsgrad nor maximize")
        if not all(_dense(_local(p)) for group in self.param_groups for p in group["params"]):
            raise ValueError("the Triton AdamW steps parameters whose elements fill their memory (no sliced "
                             "views); set optimizer.implementation = 'fused'")
        self.gradient_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: p.grad
        self.copy_of: Callable[[torch.Tensor], torch.Tensor | None] = lambda p: None

    def _state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (also what `torch.distributed.checkpoint` calls), then each loaded state
        made ready for the kernel once, off the step's path: its step counted on the host (a
        fused optimizer's is a device tensor; read on the host, it never waits for the GPU), its
        moments laid out as the parameter (a checkpoint's are contiguous)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                state["step"] = state["step"].cpu()
                for key in ("exp_avg", "exp_avg_sq"):
                    if not isinstance(param, DTensor):
                        state[key] = _laid_out_like(state[key], param)
                    elif not _same_layout(_local(state[key]), _local(param)):
                        raise ValueError("the Triton AdamW needs each parameter's moments laid out as the "
                                         "parameter; set optimizer.implementation = 'fused'")

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> None:
        if closure is not None:
            raise ValueError("the Triton AdamW takes no closure")
        cdiv, kernel = _kernel()
        divisor = getattr(self, "grad_scale", None)
        if divisor is not None:
            divisor = _local(divisor)
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            lr_weight_decay = lr * group["weight_decay"]
            for param in group["params"]:
                grad = self.gradient_of(param)
                if grad is None:
                    continue
                state = self._state(param)
                state["step"] += 1
                step = state["step"].item()
                p, m, v = _local(param), _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                if p.numel() == 0:  # an empty shard
                    continue
                g = _laid_out_like(_local(grad), p)
                if divisor is None:
                    divisor = torch.ones((), device=p.device)
                copy = self.copy_of(param)
                if copy is not None and (copy.dtype != torch.bfloat16 or not _same_layout(copy, p)):
                    raise ValueError("a weight copy must be bf16 and laid out as its parameter")
                kernel[(cdiv(p.numel(), BLOCK),)](
                    p, g, m, v, divisor, p.numel(),
                    beta1, beta2, eps, lr_weight_decay, lr / (1 - beta1**step), (1 - beta2**step) ** 0.5,
                    p if copy is None else copy,
                    BLOCK=BLOCK, WRITES_COPY=copy is not None, num_warps=8,
                )
