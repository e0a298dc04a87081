"""Llama 3 <-> Hugging Face `LlamaForCausalLM`: parameter names, RoPE row order, config.json.

Our names follow torchtitan and our RoPE rotates interleaved pairs (x[2i], x[2i+1]) like
Meta's reference code; HF's rotates halves (x[i], x[i + head_dim/2]). The same attention
results from permuting the rows of wq and wk inside every head (rows 0, 2, 4, ..., then
1, 3, 5, ...), as Meta's Llama -> HF conversion does. The permutation never crosses a head,
so it applies to any block of whole heads: a rank's shard on load is widened to whole
heads, permuted, and cut back.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from models.llama3.args import ModelArgs

_NAMES = [
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.wq\.weight", "model.layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.wk\.weight", "model.layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.wv\.weight", "model.layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
]

# config.json keys that fix tensor shapes or the RoPE row order: a mismatch is an error.
_LAYOUT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim")


def interleaved_to_halves(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the rows of each head from interleaved-pair RoPE to HF's rotate-half RoPE."""
    n, cols = rows.shape
    return rows.view(n // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(n, cols)


def halves_to_interleaved(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `interleaved_to_halves`."""
    n, cols = rows.shape
    return rows.view(n // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(n, cols)


def _rope_scaling(args: ModelArgs) -> dict | None:
    """Llama 3.1 frequency scaling is HF's "llama3" rope type."""
    if not args.use_scaled_rope:
        return None
    return {
        "rope_type": "llama3",
        "factor": args.rope_scale_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_seq_len,
    }


def _file_rope(config: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, rope scaling) of a config.json, in either transformers' v4 keys
    (`rope_theta`, `rope_scaling`) or v5 keys (`rope_parameters`)."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    scaling = config.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is None:
        return theta, None
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return theta, {"rope_type": scaling.get("rope_type", scaling.get("type")), **{k: scaling.get(k) for k in keys}}


class Llama3HF:
    """The HF adapter of one Llama 3 model (see `models.HFAdapter`)."""

    vocab_keys = frozenset({"tok_embeddings.weight", "output.weight"})

    def __init__(self, args: ModelArgs) -> None:
        self.args = args

    def hf_name(self, name: str) -> str:
        for pattern, template in _NAMES:
            m = re.fullmatch(pattern, name)
            if m:
                return template.format(*m.groups())
        raise KeyError(f"no Hugging Face Llama name for parameter '{name}'")

    def hf_source(self, name: str, config: dict) -> str:
        # Llama 3.2 1B and 3B tie the head to the embedding and store no lm_head.weight.
        if name == "output.weight" and config.get("tie_word_embeddings"):
            return "model.embed_tokens.weight"
        return self.hf_name(name)

    def row_group(self, name: str) -> int:
        return self.args.head_dim if name.endswith(("attention.wq.weight", "attention.wk.weight")) else 1

    def to_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        if self.row_group(name) > 1:
            return interleaved_to_halves(rows, self.args.head_dim)
        return rows

    def from_hf(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        if self.row_group(name) > 1:
            return halves_to_interleaved(rows, self.args.head_dim)
        return rows

    def hf_config(self, *, dtype: torch.dtype, vocab_size: int | None = None) -> dict:
        a = self.args
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_hidden_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": vocab_size if vocab_size is not None else a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "initializer_range": 0.02,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        scaling = _rope_scaling(a)
        if scaling is not None:
            config["rope_scaling"] = scaling
        return config

    def config_problems(self, config: dict) -> tuple[list[str], list[str]]:
        ours = self.hf_config(dtype=torch.float32)
        errors, warnings = [], []
        model_type = config.get("model_type", "llama")
        if model_type != "llama":
            errors.append(f"model_type is '{model_type}', and this model loads Llama ('llama') weights only")
        theirs = dict(config)
        if "num_attention_heads" in config:  # HF's default: as many kv heads as heads
            theirs.setdefault("num_key_value_heads", config["num_attention_heads"])
        for key in _LAYOUT_KEYS:
            if key in theirs and theirs[key] != ours[key]:
                errors.append(f"{key} is {theirs[key]}, this model has {ours[key]}")
        if "rms_norm_eps" in config and config["rms_norm_eps"] != ours["rms_norm_eps"]:
            warnings.append(f"rms_norm_eps is {config['rms_norm_eps']}, this model uses {ours['rms_norm_eps']}")
        theta, scaling = _file_rope(config)
        if theta is not None and theta != ours["rope_theta"]:
            warnings.append(f"rope_theta is {theta}, this model uses {ours['rope_theta']}")
        if scaling != ours.get("rope_scaling"):
            warnings.append(f"RoPE scaling is {scaling}, this model uses {ours.get('rope_scaling')}")
        return errors, warnings


def hf_adapter(args: ModelArgs | dict[str, Any]) -> Llama3HF:
    """The adapter for `args`, or for their asdict() form as a checkpoint's fingerprint stores them."""
    if isinstance(args, dict):
        known = {f.name for f in dataclasses.fields(ModelArgs)}
        args = ModelArgs(**{k: v for k, v in args.items() if k in known})
    return Llama3HF(args)
