"""Convert a weft DCP checkpoint folder to Hugging Face format (safetensors + config.json).

    python scripts/convert_to_hf.py outputs/checkpoint/step-1000 hf_out [--dtype bfloat16] [--vocab-size 100277]

Runs on one process without a process group, whatever mesh wrote the checkpoint. Model args
(dim, n_heads, n_kv_heads, rope_theta, ...) come from the checkpoint's fingerprint.json; the
flags below override them. Files over 5 GB are split into shards with an index, as HF does.
OUT_DIR is replaced as a whole, so it must be new, empty, or an earlier export.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models import MODEL_NAMES, get_model_spec  # noqa: E402
from trainer.checkpoint_safety import CheckpointReadError, load_model_state_dict  # noqa: E402
from trainer.export import export_hf, foreign_files, read_model_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint_dir", help="a complete step-<N> folder")
    p.add_argument("out_dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--vocab-size", type=int, default=None, help="trim padded vocab rows to this size")
    p.add_argument("--model", default="llama3", choices=MODEL_NAMES, help="model family of the checkpoint")
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
    if not model_args.get("dim"):
        p.error("the checkpoint's fingerprint.json stores no model args (written by a weft trainer, it does)")
    foreign = foreign_files(a.out_dir)
    if foreign:
        p.error(f"{a.out_dir} holds files an export does not write (e.g. {foreign[0]}) and would be replaced; "
                "pass a new or empty folder")
    adapter = get_model_spec(a.model).hf_adapter(model_args)
    try:
        state_dict = load_model_state_dict(a.checkpoint_dir)  # runs no code stored in the checkpoint
    except CheckpointReadError as e:
        print(f"convert_to_hf: {e}", file=sys.stderr)
        return 2
    export_hf(state_dict, adapter, a.out_dir, dtype=getattr(torch, a.dtype), vocab_size=a.vocab_size)
    print(f"wrote {a.out_dir}: safetensors and config.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
