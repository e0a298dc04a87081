"""Throughput / memory / compile-health benchmark: run train.py for several variants, print a table.

Each variant is one `torchrun train.py` launch with the shared overrides plus its own; the
table reports the median over the steps after `--skip` warm-up steps (compilation happens in
the first steps) of tokens/s per device, MFU, achieved TFLOP/s and peak memory, plus the
compile counters of the last step. Results are also written as JSON next to the logs.

    python scripts/benchmark.py --nproc 1 --out outputs/bench \
        --variant eager: --variant blocks:--compile.enable,--compile.strategy,blocks \
        -- --job.config_file train_configs/llama3_3b.toml --training.steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(name: str, overrides: list[str], shared: list[str], nproc: int, out: str) -> dict:
    dump = os.path.join(out, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--local-ranks-filter=0", "train.py",
           *shared, *overrides, "--job.dump_folder", dump, "--metrics.log_freq", "1"]
    start = time.time()
    shutil.rmtree(dump, ignore_errors=True)  # metrics.jsonl appends; a rerun must not mix in old steps
    os.makedirs(dump)
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - start
    records = []
    metrics_path = os.path.join(dump, "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            records = [json.loads(line) for line in f]
    return {"name": name, "returncode": proc.returncode, "wall_s": wall, "records": records}


def summarize(result: dict, skip: int) -> dict:
    steady = [r for r in result["records"] if r["step"] > skip]
    last = result["records"][-1] if result["records"] else {}

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "variant": result["name"],
        "ok": result["returncode"] == 0,
        "tps": median("tps"),
        "mfu_pct": median("mfu"),
        "tflops": median("tflops"),
        "step_s": median("step_time_s"),
        "mem_active_gib": max((r.get("memory_max_active_gib") or 0 for r in steady), default=None),
        "mem_reserved_gib": max((r.get("memory_max_reserved_gib") or 0 for r in steady), default=None),
        "final_loss": last.get("loss"),
        "recompiles_after_warmup": last.get("recompiles_after_warmup"),
        "graph_breaks": last.get("graph_breaks"),
        "unique_graphs": last.get("unique_graphs"),
        "compile_s": last.get("compile_time_s"),
        "wall_s": round(result["wall_s"], 1),
    }


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    fmt = lambda v: "-" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))  # noqa: E731
    widths = [max(len(c), *(len(fmt(r[c])) for r in rows)) for c in cols]
    lines = [" | ".join(c.ljust(w) for c, w in zip(cols, widths)), "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(fmt(r[c]).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    if "--" not in sys.argv:
        sys.exit("usage: benchmark.py [options] -- SHARED_OVERRIDES (see the module docstring)")
    split = sys.argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    parser.add_argument("--variant", action="append", required=True,
                        help="NAME:comma,separated,overrides (empty overrides allowed)")
    args = parser.parse_args(sys.argv[1:split])
    shared = sys.argv[split + 1:]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for spec in args.variant:
        name, _, overrides = spec.partition(":")
        result = run_variant(name, [o for o in overrides.split(",") if o], shared, args.nproc, args.out)
        rows.append(summarize(result, args.skip))
        print(table(rows[-1:]), flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n" + table(rows))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
