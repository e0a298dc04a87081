"""Model-family-agnostic compute helpers that pick the fastest correct kernel for their inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _sdpa_takes_grouped_kv(q: torch.Tensor) -> bool:
    """Whether a fused SDPA kernel accepts fewer KV heads than query heads for q's device/dtype.

    From aten/src/ATen/native/transformers/cuda/sdp_utils.cpp and sdp_utils_cpp.cpp: on CUDA,
    flash and cuDNN attention take grouped KV heads, for bf16/fp16 only; on torch 2.11
    memory-efficient attention (the fused kernel for fp32) rejects them, so an fp32 CUDA call
    with grouped heads would fall back to the math kernel and its O(seq^2) memory. The CPU
    flash kernel takes grouped heads for every dtype (checked on 2.13).
    """
    return q.device.type != "cuda" or q.dtype in (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of q [b, h, s, d] over k, v [b, h_kv, s, d], h a multiple of h_kv.

    Grouped KV heads go to the kernel as they are (`enable_gqa`), so no repeated copy of K
    and V is written in forward and read again in backward (about 45 ms per step at 3B on an
    H200, issue 10). Where the fused kernel cannot take them, K and V are repeated first.
    Under tensor parallelism q, k, v hold this rank's heads, whose ratio is the global one.
    """
    grouped = k.shape[1] != q.shape[1]
    if grouped and not _sdpa_takes_grouped_kv(q):
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        grouped = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
