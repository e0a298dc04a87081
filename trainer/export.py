"""Export a Llama model to Hugging Face format: one unsharded .safetensors + config.json.

Our parameter names follow torchtitan and our RoPE rotates interleaved pairs
(x[2i], x[2i+1]) like the Llama reference code; HF `LlamaForCausalLM` rotates halves
(x[i], x[i + head_dim/2]). The same attention results from permuting the rows of
wq and wk inside every head (rows 0,2,4,..., then 1,3,5,...), as Meta's
Llama -> HF conversion does.

Vocabulary: the embedding and output rows padded for TP are kept by default (HF
`vocab_size` is then the padded size; the tokenizer never emits those ids); pass
`vocab_size` to trim to the real tokenizer size.

The `safetensors` package is not a dependency, so the format is written here. It is:
8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}`
(space-padded to a multiple of 8), then the raw little-endian tensor bytes, offsets
relative to the end of the header, with no gaps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from trainer.checkpoint import FINGERPRINT

SAFETENSORS_FILE = "model.safetensors"

_ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}

_HF_NAMES = [
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


def hf_name(name: str) -> str:
    """HF Llama name of one of our parameter names; KeyError for anything else."""
    for pattern, template in _HF_NAMES:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups())
    raise KeyError(f"no Hugging Face Llama name for parameter '{name}'")


def permute_for_hf_rope(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder wq/wk rows per head from interleaved-pair RoPE to HF's rotate_half RoPE."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    return weight.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _args_dict(model_args: Any) -> dict:
    return dataclasses.asdict(model_args) if dataclasses.is_dataclass(model_args) else dict(model_args)


def to_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    model_args: Any,
    *,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Rename to HF names, permute wq/wk for rotate_half RoPE, optionally trim vocab and cast.

    `model_args` (dict or dataclass) needs n_heads; n_kv_heads defaults to n_heads.
    """
    args = _args_dict(model_args)
    if not args.get("n_heads"):
        raise ValueError("model args need n_heads to export wq/wk for Hugging Face RoPE")
    n_heads = args["n_heads"]
    n_kv_heads = args.get("n_kv_heads") or n_heads
    out = {}
    for name, tensor in state_dict.items():
        t = tensor.detach()
        if name.endswith("attention.wq.weight"):
            t = permute_for_hf_rope(t, n_heads)
        elif name.endswith("attention.wk.weight"):
            t = permute_for_hf_rope(t, n_kv_heads)
        elif vocab_size is not None and name in ("tok_embeddings.weight", "output.weight"):
            if vocab_size > t.shape[0]:
                raise ValueError(f"vocab_size {vocab_size} is larger than the model's {t.shape[0]} rows")
            t = t[:vocab_size]
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[hf_name(name)] = t.contiguous()
    return out


def hf_config(hf_state_dict: dict[str, torch.Tensor], model_args: Any) -> dict:
    """config.json for LlamaForCausalLM; sizes come from the tensors, the rest from model args."""
    args = _args_dict(model_args)
    embed = hf_state_dict["model.embed_tokens.weight"]
    vocab, dim = embed.shape
    n_heads = args["n_heads"]
    n_layers = len({k.split(".")[2] for k in hf_state_dict if k.startswith("model.layers.")})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": hf_state_dict["model.layers.0.mlp.gate_proj.weight"].shape[0],
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": args.get("n_kv_heads") or n_heads,
        "head_dim": dim // n_heads,
        "vocab_size": vocab,
        "max_position_embeddings": args.get("max_seq_len", 2048),
        "rms_norm_eps": args.get("norm_eps", 1e-5),
        "rope_theta": args.get("rope_theta", 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "torch_dtype": str(embed.dtype).removeprefix("torch."),
    }
    if args.get("use_scaled_rope"):  # Llama 3.1 frequency scaling is HF's "llama3" rope type
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": args["rope_scale_factor"],
            "low_freq_factor": args["rope_low_freq_factor"],
            "high_freq_factor": args["rope_high_freq_factor"],
            "original_max_position_embeddings": args["rope_original_max_seq_len"],
        }
    return config


def save_safetensors(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (CPU or not, any layout) as one safetensors file."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors are little-endian; this writer does not byte-swap")
    # Largest element size first keeps every tensor aligned to its element size.
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors code")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            t = tensors[name].detach().to("cpu").contiguous().reshape(-1)
            if t.numel():
                f.write(t.view(torch.uint8).numpy())


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Read a safetensors file written by any writer (used by tests and for checks)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = bytearray(f.read())
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _ST_TORCH[info["dtype"]]
        if end == begin:
            out[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, offset=begin, count=end - begin).clone()
        out[name] = raw.view(dtype).reshape(info["shape"])
    return out


def write_hf_checkpoint(
    state_dict: dict[str, torch.Tensor],
    model_args: Any,
    out_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> None:
    """Write `<out_dir>/model.safetensors` and `<out_dir>/config.json` from a full, unsharded state dict."""
    hf = to_hf_state_dict(state_dict, model_args, vocab_size=vocab_size, dtype=dtype)
    os.makedirs(out_dir, exist_ok=True)
    save_safetensors(hf, os.path.join(out_dir, SAFETENSORS_FILE))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(hf, model_args), f, indent=2)


def export_hf(
    model: nn.Module,
    model_args: Any,
    out_dir: str,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> None:
    """Gather the (FSDP/TP-sharded) model onto rank 0's CPU and write it in HF format there.

    Collective when distributed: call it on every rank.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    write_hf_checkpoint(full, model_args, out_dir, dtype=dtype, vocab_size=vocab_size)


def read_model_args(ckpt_dir: str) -> dict:
    """Model args stored in a checkpoint's fingerprint file ({} when none were given)."""
    with open(os.path.join(ckpt_dir, FINGERPRINT)) as f:
        return json.load(f).get("model_args") or {}
