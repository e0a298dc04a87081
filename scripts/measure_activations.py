"""Measure what one Llama 3 block keeps for backward on CPU, per checkpointing kind, eager and
compiled, next to models/llama3/memory.py's count: the check behind the activation estimate.

    python scripts/measure_activations.py            # eager and compiled (compiling takes minutes)
    python scripts/measure_activations.py --eager    # eager only (seconds)

The block has Llama's structure at a small size (grouped-query attention with 128-wide heads,
SwiGLU at 8/3 x dim) in bfloat16. Eager counts every storage the forward leaves alive
(`retained_bytes`), compiled counts what AOTAutograd saves (`saved_tensor_bytes`); the block
input is the caller's and not counted, so "full" and "op", which keep it, are compared with the
count minus one residual-stream tensor. CPU's rms_norm is the composite kernel, so the count
uses fused_norm=False here; CUDA's fused kernel saves less, as the count says.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from models.llama3.args import ModelArgs  # noqa: E402
from models.llama3.memory import check_block  # noqa: E402

ARGS = ModelArgs(dim=384, n_layers=1, n_heads=3, n_kv_heads=1, ffn_dim_multiplier=1.0, multiple_of=256,
                 vocab_size=512, max_seq_len=512)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eager", action="store_true", help="skip the compiled measurements")
    args = parser.parse_args()
    print(f"one block, dim {ARGS.dim}, FFN {ARGS.ffn_hidden_dim}, 512 tokens, bfloat16, torch {torch.__version__}")
    print("| kind | mode | measured bytes | counted bytes | difference |")
    print("|---|---|---|---|---|")
    for compiled in (False,) if args.eager else (False, True):
        for kind in ("none", "full", "op", "op_all"):
            measured, counted = check_block(ARGS, kind, 512, compiled=compiled)
            mode = "compiled" if compiled else "eager"
            print(f"| {kind} | {mode} | {measured:,} | {counted:,} | {measured - counted:+,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
