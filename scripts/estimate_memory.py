"""Print the dry run's per-rank memory estimate for several variants of a config (no GPU needed).

Takes the same `--variant name:overrides` and shared overrides as scripts/benchmark.py, so the
estimate of each benchmark row sits next to its measured `memory_max_active_gib`:

    python scripts/estimate_memory.py --nproc 1 \
        --variant sac_eager:--compile.enable,false \
        --variant sac_blocks: \
        --variant full_blocks:--activation_checkpoint.mode,full \
        -- --job.config_file train_configs/llama3_3b.toml --training.local_batch_size 2

Each variant is planned as `train.py --comm.mode fake_backend --comm.fake_world_size NPROC`
would plan it (on PyTorch's fake process group, in this one process); `--measured
name=GiB` adds the error of the estimate against a measured peak.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark import free_form_variant  # noqa: E402

from parallel.memory import GIB  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dry_run import plan  # noqa: E402
from trainer.errors import WeftError  # noqa: E402


def _row(name: str, argv: list[str], nproc: int, measured: dict[str, float]) -> dict[str, str]:
    p = plan(load_config([*argv, "--comm.mode", "fake_backend"]), nproc)
    m, peak = p.memory, p.memory.peak
    row = {
        "variant": name,
        "params": m.state.params,
        "grads": m.state.grads,
        "optimizer": m.state.optimizer,
        "activations": m.activation_total,
        "loss bwd": m.loss[2],
        "peak": peak.total,
    }
    row = {k: (f"{v / GIB:.2f}" if isinstance(v, int) else v) for k, v in row.items()}
    row["peak phase"] = peak.name
    if name in measured:
        row["measured"] = f"{measured[name]:.2f}"
        row["error"] = f"{(peak.total / GIB - measured[name]) / measured[name]:+.1%}"
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1, help="world size to plan for")
    parser.add_argument("--variant", action="append", default=[], help="name:--key,value,... (a comma starts a new argument only before --, as in benchmark.py)")
    parser.add_argument("--measured", action="append", default=[], help="name=GiB measured peak (max active)")
    args, shared = parser.parse_known_args()
    shared = [a for a in shared if a != "--"]
    measured = {k: float(v) for k, v in (m.split("=", 1) for m in args.measured)}
    variants = [free_form_variant(v) for v in args.variant or ["default:"]]
    rows = []
    for variant in variants:
        try:
            rows.append(_row(variant.name, shared + variant.overrides, args.nproc, measured))
        except WeftError as e:
            rows.append({"variant": variant.name, "peak phase": f"{e.label}: {e}"})
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print("GiB per rank (rank 0)")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(r.get(c, "") for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
