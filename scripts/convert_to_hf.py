"""Convert a weft DCP checkpoint folder to Hugging Face Llama format (safetensors + config.json).

    python scripts/convert_to_hf.py outputs/checkpoint/step-1000 hf_out [--dtype bfloat16] [--vocab-size 100277]

Runs on one process without a process group, whatever mesh wrote the checkpoint.
Model args (n_heads, n_kv_heads, rope_theta, ...) come from the checkpoint's
fingerprint.json; the flags below override or supply them.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer.checkpoint_safety import CheckpointReadError, load_model_state_dict  # noqa: E402
from trainer.export import read_model_args, write_hf_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", help="a complete step-<N> folder")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--vocab-size", type=int, default=None, help="trim padded vocab rows to this size")
    p.add_argument("--n-heads", type=int)
    p.add_argument("--n-kv-heads", type=int)
    p.add_argument("--rope-theta", type=float)
    p.add_argument("--norm-eps", type=float)
    p.add_argument("--max-seq-len", type=int)
    a = p.parse_args(argv)

    if not os.path.isfile(os.path.join(a.checkpoint_dir, ".metadata")):
        p.error(f"{a.checkpoint_dir} is not a complete DCP checkpoint (no .metadata); pass a step-<N> folder")
    model_args = read_model_args(a.checkpoint_dir)
    overrides = {
        "n_heads": a.n_heads,
        "n_kv_heads": a.n_kv_heads,
        "rope_theta": a.rope_theta,
        "norm_eps": a.norm_eps,
        "max_seq_len": a.max_seq_len,
    }
    model_args.update({k: v for k, v in overrides.items() if v is not None})
    if not model_args.get("n_heads"):
        p.error("the checkpoint stores no model args; pass at least --n-heads (and --n-kv-heads, --rope-theta)")
    try:
        state_dict = load_model_state_dict(a.checkpoint_dir)  # runs no code stored in the checkpoint
    except CheckpointReadError as e:
        print(f"convert_to_hf: {e}", file=sys.stderr)
        return 2
    write_hf_checkpoint(state_dict, model_args, a.out_dir, dtype=getattr(torch, a.dtype), vocab_size=a.vocab_size)
    print(f"wrote {a.out_dir}/model.safetensors and config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
