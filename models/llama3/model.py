"""Llama 3 decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied output head.

Written for tensor parallelism without knowing about it: head counts are derived from the
(possibly sharded) projection outputs with `view(..., -1, head_dim)`, so the same code runs
on full weights and on the column-sharded local weights of a TP rank.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import causal_attention
from models.llama3.args import ModelArgs

# init_normal(param, std, bound): fill `param` with N(0, std), truncated at +-bound when
# bound is not None. The trainer passes a sharding-aware version; see parallel/init.py.
InitNormal = Callable[[torch.Tensor, float, Optional[float]], None]


@torch.no_grad()
def init_normal_(param: torch.Tensor, std: float, bound: float | None) -> None:
    if bound is None:
        nn.init.normal_(param, mean=0.0, std=std)
    else:
        nn.init.trunc_normal_(param, mean=0.0, std=std, a=-bound, b=bound)


def rope_table(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """cos and signed sin of every position's angles, shape [max_seq_len, 2, head_dim], fp32.

    Laid out for `apply_rope`: each frequency's angle is repeated for its (even, odd) pair, and
    the sin row holds (-sin, +sin) per pair, so the rotation is two multiplies and an add on
    the input dtype with no stride-2 access.
    """
    half = args.head_dim // 2
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    if args.use_scaled_rope:
        freqs = _scale_rope_freqs(freqs, args)
    t = torch.arange(args.max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, freqs).repeat_interleave(2, dim=-1)
    sign = torch.tensor([-1.0, 1.0], device=device).repeat(half)
    return torch.stack([angles.cos(), angles.sin() * sign], dim=1)


def _scale_rope_freqs(freqs: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Llama 3.1 frequency scaling: stretch low frequencies, keep high ones, blend between."""
    low_wavelen = args.rope_original_max_seq_len / args.rope_low_freq_factor
    high_wavelen = args.rope_original_max_seq_len / args.rope_high_freq_factor
    wavelen = 2 * math.pi / freqs
    smooth = (args.rope_original_max_seq_len / wavelen - args.rope_low_freq_factor) / (
        args.rope_high_freq_factor - args.rope_low_freq_factor
    )
    blended = (1 - smooth) * freqs / args.rope_scale_factor + smooth * freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / args.rope_scale_factor, blended)
    return torch.where(wavelen < high_wavelen, freqs, scaled)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved (even, odd) pairs of x [b, s, h, d] as the Llama reference does.

    out[2i] = x[2i] cos - x[2i+1] sin and out[2i+1] = x[2i+1] cos + x[2i] sin, computed as
    x * cos + swap_pairs(x) * signed_sin on x's dtype (the table is cast, which is tiny):
    in eager that is three passes over x instead of a dozen fp32 ones; under compile it is
    one fused kernel either way. The interleaved-pair layout is what the HF export's wq/wk
    permutation assumes.
    """
    seqlen, head_dim = x.shape[1], x.shape[-1]
    cos, sin = table[:seqlen].to(x.dtype).view(1, seqlen, 2, 1, head_dim).unbind(2)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return torch.addcmul(x * cos, swapped, sin)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on x's dtype: F.rms_norm accumulates in fp32 for bf16/fp16 inputs
        # (CUDA `_fused_rms_norm` since torch 2.8, the CPU composite and inductor's
        # decomposition all upcast internally), so explicit fp32 casts only add passes. The
        # weight follows x's dtype (a no-op under FSDP mixed precision) so the fused kernel,
        # not the mixed-dtype composite, runs.
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))

    def init_weights(self, init_normal: InitNormal, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            init_normal(linear.weight, 0.02, 2.0)
        init_normal(self.wo.weight, out_std, 2.0)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_normal: InitNormal, out_std: float) -> None:
        init_normal(self.w1.weight, 0.02, 2.0)
        init_normal(self.w2.weight, out_std, 2.0)
        init_normal(self.w3.weight, out_std, 2.0)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        depth = layer_id + 1 if args.depth_init else args.n_layers
        self.out_std = 0.02 / (2 * depth) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, init_normal: InitNormal) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(init_normal, self.out_std)
        self.feed_forward.init_weights(init_normal, self.out_std)


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab_size] (or the loss, given labels)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError("ModelArgs.vocab_size must be set (from the tokenizer) before building the model")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps parameter names stable ("layers.3.…") even
        # when a later pipeline stage holds only some of the layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope", rope_table(args), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits, or with `labels` the mean loss, which only a head that takes labels computes
        (`parallel.loss.fuse_loss_into_head`; the trainer installs it, see training.head_loss)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h)
        return self.output(h) if labels is None else self.output(h, labels)

    @torch.no_grad()
    def init_weights(self, init_normal: InitNormal = init_normal_, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter and buffer; used after meta-device construction."""
        self.rope = rope_table(self.args, device=buffer_device or self.rope.device)
        init_normal(self.tok_embeddings.weight, 1.0, None)
        for layer in self.layers.values():
            layer.init_weights(init_normal)
        self.norm.reset_parameters()
        std = self.args.dim ** -0.5
        init_normal(self.output.weight, std, 3 * std)

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Global (unsharded) parameter count."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token as torchtitan counts them: 6 N + 12 L d s (N excludes embedding)."""
        a = self.args
        return 6 * self.num_params(exclude_embedding=True) + 12 * a.n_layers * a.dim * seq_len
