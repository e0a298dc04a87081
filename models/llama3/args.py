"""Llama 3 hyper-parameters and the published size presets ("flavors")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Vocab sizes are padded to a multiple of this so that any tensor-parallel degree up to
# 512 (every power of two we support) divides the embedding and output rows evenly, and
# so the matmul shapes stay GPU friendly.
VOCAB_PAD_MULTIPLE = 512


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None
    vocab_size: int = -1  # set from the tokenizer (padded) before the model is built
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    use_scaled_rope: bool = False  # Llama 3.1 long-context frequency scaling
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048  # RoPE table length; set from training.seq_len
    depth_init: bool = True  # scale output-projection init by layer depth (Llama 3 reference)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """Llama's SwiGLU hidden size: 2/3 of 4*dim, scaled, rounded up to `multiple_of`."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def padded_vocab_size(n_words: int, requested: int = 0) -> int:
    """The embedding/output row count: `requested` exactly when set (e.g. Llama 3's 128,256 for
    shape-matched benchmarks), else the tokenizer size rounded up to VOCAB_PAD_MULTIPLE."""
    if requested:
        if requested < n_words:
            raise ValueError(f"model.vocab_size={requested} is smaller than the tokenizer's {n_words} tokens")
        return requested
    return VOCAB_PAD_MULTIPLE * ((n_words + VOCAB_PAD_MULTIPLE - 1) // VOCAB_PAD_MULTIPLE)


_LLAMA31 = dict(use_scaled_rope=True, rope_scale_factor=8.0)
_LLAMA32 = dict(use_scaled_rope=True, rope_scale_factor=32.0)

FLAVORS: dict[str, ModelArgs] = {
    # Small enough for multi-process CPU tests.
    "tinymodel": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, multiple_of=32),
    # The default debug run: trains in a few minutes on a 2-core CPU (the 100k-token
    # vocabulary's embedding and head dominate its cost).
    "debugmodel": ModelArgs(dim=128, n_layers=4, n_heads=8, n_kv_heads=4, multiple_of=64),
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5,
                    multiple_of=256, **_LLAMA32),
    "3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0,
                    multiple_of=256, **_LLAMA32),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, **_LLAMA31),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, **_LLAMA31),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, **_LLAMA31),
}


def flavor_args(flavor: str, *, vocab_size: int, max_seq_len: int) -> ModelArgs:
    """A copy of the preset with the run-dependent sizes filled in."""
    return dataclasses.replace(FLAVORS[flavor], vocab_size=vocab_size, max_seq_len=max_seq_len)
