"""Throughput and memory of weft's variants, side by side with torchtitan's, in one table.

Presets mirror the torchtitan anchor (/work/shared/anchors/torchtitan, copied into the
git-ignored `.anchor/torchtitan` of the checkout) and its variants:

    sac        per-block compile + op-level selective AC
    sac_eager  no compile + op-level selective AC
    noac       per-block compile, no AC
    full       per-block compile + full AC
    sac_eager_all    sac_eager saving every matmul output (activation_checkpoint.op_sac_matmuls
                     = all); compared against torchtitan's sac_eager row
    sac_all_compact  sac saving every matmul output, with training.compact_gradients (one GPU)
                     and the step after backward; compared against torchtitan's full row (the
                     8B preset's memory-matched run)
    budgetNN   per-block compile + activation_checkpoint.mode memory_budget at 0.NN (weft
               only; compared against torchtitan's sac row)
    opallNN    per-block compile + activation_checkpoint.mode per_block: NN blocks op SAC saving
               every matmul, the rest op SAC (compared against torchtitan's sac row)
    opNN       per-block compile + per_block: NN blocks op SAC, the rest full AC (compared
               against torchtitan's full row); the dry run names the NN that fits

    python scripts/benchmark.py --preset 3b --variants sac,sac_eager \\
        --torchtitan-wheels .anchor_wheels --out outputs/bench_3b
    python scripts/benchmark.py --preset 8b --torchtitan-wheels .anchor_wheels --out outputs/bench_8b
    python scripts/benchmark.py --preset 3b --variants sac --profile --torchtitan-wheels .anchor_wheels
    python scripts/benchmark.py --loss-curve --out outputs/curve

Each variant is one `torchrun train.py` launch; each torchtitan variant they are compared with
is one anchor `run.sh` launch, shared by every weft row that names it. The table
holds medians over the steps after `--skip` (tokens/s per GPU, MFU), the maxima of max
active / max reserved memory over the same steps, and weft's recompiles after warm-up.
Where nvidia-smi is installed, it also holds each run's median SM clock and board power
while the GPU was busy (scripts/gpu_clocks.py): at a power limit the clock moves tokens/s.
`--profile` also traces step 10 of each run with torch.profiler and prints a kernel-time
breakdown per variant (scripts/trace_summary.py). `--loss-curve` trains the 1B flavor
twice with the same seed and data, on the current paths and on the pre-issue-10 ones
(tests/reference_paths.py), and checks every step's loss within 1%.

Free-form variants still work: `--variant NAME[@ANCHOR_VARIANT]:comma,separated,overrides`,
plus shared overrides after `--`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_clocks import ClockSampler  # noqa: E402
from trace_summary import format_breakdown, summarize as summarize_trace  # noqa: E402

PROFILE_STEP = 10
CURVE_TOLERANCE = 0.01


@dataclass(frozen=True)
class Preset:
    config: str
    local_batch: int
    anchor_flavor: str
    n_layers: int  # for the per_block layouts of the opallNN / opNN variants
    variants: tuple[str, ...]


PRESETS = {
    "3b": Preset("train_configs/llama3_3b.toml", 2, "3B", 28, ("sac", "sac_eager", "sac_eager_all", "noac", "full")),
    "8b": Preset("train_configs/llama3_8b.toml", 1, "8B", 32, ("full", "sac_all_compact")),
}

_COMPILED = ["--compile.enable", "true", "--compile.strategy", "blocks"]
_OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
_ALL_MATMULS = ["--activation_checkpoint.op_sac_matmuls", "all"]
NAMED_VARIANTS = {
    "sac": (_COMPILED + _OP_SAC, "sac"),
    "sac_eager": (["--compile.enable", "false"] + _OP_SAC, "sac_eager"),
    "noac": (_COMPILED + ["--activation_checkpoint.mode", "none"], "noac"),
    "full": (_COMPILED + ["--activation_checkpoint.mode", "full"], "full"),
    "sac_eager_all": (["--compile.enable", "false"] + _OP_SAC + _ALL_MATMULS, "sac_eager"),
    # The step after backward, as when the 8B row was measured within torchtitan's memory: the
    # overlapped step (on by default with the Triton AdamW) reserved 1.0-1.5 GiB more elsewhere.
    "sac_all_compact": (_COMPILED + _OP_SAC + _ALL_MATMULS
                        + ["--training.compact_gradients", "true", "--optimizer.overlap_step", "off"], "full"),
}


@dataclass
class Variant:
    name: str
    overrides: list[str]
    anchor: str | None  # the torchtitan variant it is compared with
    script: str = "train.py"


def named_variant(name: str, preset: Preset | None) -> Variant:
    if name in NAMED_VARIANTS:
        overrides, anchor = NAMED_VARIANTS[name]
        return Variant(name, list(overrides), anchor)
    budget = re.fullmatch(r"budget(\d\d)", name)
    if budget:
        overrides = _COMPILED + ["--activation_checkpoint.mode", "memory_budget",
                                 "--activation_checkpoint.memory_budget", f"0.{budget.group(1)}"]
        return Variant(name, overrides, "sac")
    layout = re.fullmatch(r"(opall|op)(\d+)", name)
    if layout:
        if preset is None:
            sys.exit(f"variant '{name}' lays out blocks of a preset's model: pass --preset")
        kind, rest, anchor = ("op_all", "op", "sac") if layout.group(1) == "opall" else ("op", "full", "full")
        count = int(layout.group(2))
        if not 0 < count <= preset.n_layers:
            sys.exit(f"variant '{name}': the {preset.anchor_flavor} model has {preset.n_layers} blocks")
        per_block = f"{kind}:{count}" + (f",{rest}:{preset.n_layers - count}" if count < preset.n_layers else "")
        overrides = _COMPILED + ["--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", per_block]
        return Variant(name, overrides, anchor)
    sys.exit(f"unknown variant '{name}': use {', '.join(NAMED_VARIANTS)}, budgetNN (e.g. budget60), "
             "opallNN or opNN (e.g. opall17)")


def free_form_variant(spec: str) -> Variant:
    """`NAME[@ANCHOR]:--key,value,--flag,...`: a comma starts a new argument only before `--`,
    so a value may hold commas (`--activation_checkpoint.per_block,op_all:16,op:12`)."""
    head, _, overrides = spec.partition(":")
    name, _, anchor = head.partition("@")
    args = [a for option in re.split(r",(?=--)", overrides) if option for a in option.split(",", 1)]
    return Variant(name, args, anchor or None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env() -> dict[str, str]:
    """What run_train.sh exports, so both frameworks run with the same allocator settings."""
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    if not env.get("PYTORCH_ALLOC_CONF") and not env.get("PYTORCH_CUDA_ALLOC_CONF"):
        env["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"
    return env


def run_weft(variant: Variant, shared: list[str], nproc: int, out: str, profile: bool) -> dict:
    dump = os.path.join(out, variant.name)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "--local-ranks-filter=0", variant.script,
           *shared, *variant.overrides, "--job.dump_folder", dump, "--metrics.log_freq", "1"]
    if profile:
        cmd += ["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(PROFILE_STEP)]
    shutil.rmtree(dump, ignore_errors=True)  # metrics.jsonl appends; a rerun must not mix in old steps
    os.makedirs(dump)
    # One token cache for every run of this benchmark (train.py keys it by data and tokenizer),
    # so the corpus is tokenized once rather than once per variant.
    shared_cache = os.path.abspath(os.path.join(out, ".cache"))
    os.makedirs(shared_cache, exist_ok=True)
    os.symlink(shared_cache, os.path.join(dump, ".cache"))
    start = time.time()
    with open(os.path.join(out, f"{variant.name}.log"), "w") as log, ClockSampler() as clocks:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=launch_env())
    records = []
    metrics_path = os.path.join(dump, "metrics.jsonl")
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            records = [r for r in map(json.loads, f) if "tps" in r]
    return {"name": variant.name, "returncode": proc.returncode, "wall_s": time.time() - start,
            "records": records, "dump": dump, "clocks": clocks.result}


def summarize(result: dict, skip: int) -> dict:
    steady = [r for r in result["records"] if r["step"] > skip]
    last = result["records"][-1] if result["records"] else {}

    def median(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    def peak(key):
        values = [r[key] for r in steady if r.get(key) is not None]
        return max(values) if values else None

    return {
        "variant": result["name"],
        "ok": result["returncode"] == 0 and bool(steady),
        "tps": median("tps"),
        "mfu_pct": median("mfu"),
        "tflops": median("tflops"),
        "step_s": median("step_time_s"),
        "mem_active_gib": peak("memory_max_active_gib"),
        "mem_reserved_gib": peak("memory_max_reserved_gib"),
        "final_loss": last.get("loss"),
        "recompiles_after_warmup": last.get("recompiles_after_warmup"),
        "graph_breaks": last.get("graph_breaks"),
        "unique_graphs": last.get("unique_graphs"),
        "compile_s": last.get("compile_time_s"),
        "wall_s": round(result["wall_s"], 1),
        **result.get("clocks", {}),
    }


_ANCHOR_LINE = re.compile(
    r"torchtitan (?P<variant>\S+)\s+lbs=\d+ tps (?P<tps>[\d,]+)\s+mfu (?P<mfu>[\d.]+)%\s+"
    r"max reserved (?P<reserved>[\d.]+) GiB(?:\s+max active (?P<active>[\d.]+) GiB)?"
)


def run_anchor(variant: str, anchor_dir: str, wheels: str, preset: Preset, out: str, profile: bool) -> dict:
    """torchtitan's run of `variant` through the anchor's run.sh, parsed from its summary line."""
    env = {**launch_env(), "ANCHOR_FLAVOR": preset.anchor_flavor, "ANCHOR_PROFILE": "true" if profile else "false"}
    start = time.time()
    with ClockSampler() as clocks:
        proc = subprocess.run(["bash", os.path.join(anchor_dir, "run.sh"), os.path.abspath(wheels),
                               os.path.join(os.path.abspath(out), "torchtitan"), str(preset.local_batch), variant],
                              cwd=ROOT, capture_output=True, text=True, env=env)
    text = proc.stdout + proc.stderr
    match = _ANCHOR_LINE.search(text)
    result = {"variant": variant, "ok": match is not None, "wall_s": round(time.time() - start, 1),
              "output": text.strip().splitlines()[-1] if text.strip() else "no output", **clocks.result}
    if match:
        result.update(tps=float(match["tps"].replace(",", "")), mfu_pct=float(match["mfu"]),
                      mem_reserved_gib=float(match["reserved"]),
                      mem_active_gib=float(match["active"]) if match["active"] else None)
    return result


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _clock(run: dict) -> str:
    return f"{_num(run.get('sm_mhz'), '.0f')} / {_num(run.get('power_w'), '.0f')}"


def comparison_table(rows: list[tuple[dict, dict | None]]) -> str:
    """One row per weft variant, beside the torchtitan row it is compared with."""
    header = ["variant", "weft tok/s", "torchtitan tok/s", "ratio", "weft MFU", "tt MFU",
              "weft active / reserved GiB", "tt active / reserved GiB", "reserved diff GiB",
              "weft recompiles after warm-up", "weft SM MHz / W", "tt SM MHz / W", "wall s (weft / tt)"]
    lines = [header]
    for weft, anchor in rows:
        anchor = anchor or {}
        ratio = weft["tps"] / anchor["tps"] if weft.get("tps") and anchor.get("tps") else None
        diff = (weft["mem_reserved_gib"] - anchor["mem_reserved_gib"]
                if weft.get("mem_reserved_gib") is not None and anchor.get("mem_reserved_gib") is not None else None)
        lines.append([
            weft["variant"] + ("" if weft["ok"] else " (FAILED)"),
            _num(weft.get("tps"), ",.0f"), _num(anchor.get("tps"), ",.0f") if anchor.get("ok", True) else "FAILED",
            _num(ratio, ".3f") + ("x" if ratio else ""),
            _num(weft.get("mfu_pct"), ".1f"), _num(anchor.get("mfu_pct"), ".1f"),
            f"{_num(weft.get('mem_active_gib'), '.1f')} / {_num(weft.get('mem_reserved_gib'), '.1f')}",
            f"{_num(anchor.get('mem_active_gib'), '.1f')} / {_num(anchor.get('mem_reserved_gib'), '.1f')}",
            _num(diff, "+.1f"), _num(weft.get("recompiles_after_warmup"), "d"), _clock(weft), _clock(anchor),
            f"{_num(weft.get('wall_s'), '.0f')} / {_num(anchor.get('wall_s'), '.0f')}",
        ])
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    text = [" | ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines]
    text.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(text)


def latest_trace(folder: str) -> str | None:
    traces = glob.glob(os.path.join(folder, "**", "rank0_trace.json"), recursive=True)
    return max(traces, key=os.path.getmtime) if traces else None


def profile_breakdowns(results: list[tuple[Variant, dict, dict | None]]) -> str:
    blocks = []
    for variant, weft, anchor in results:
        columns = {}
        trace = latest_trace(weft["dump"])
        if trace:
            columns["weft"] = summarize_trace(trace)
        if anchor is not None:  # run.sh keeps torchtitan's dump folders under /tmp/anchor_work
            tt_trace = latest_trace(f"/tmp/anchor_work/out_{variant.anchor}")
            if tt_trace:
                columns["torchtitan"] = summarize_trace(tt_trace)
        if columns:
            blocks.append(f"{variant.name} (ms per step, step {PROFILE_STEP}):\n{format_breakdown(columns)}")
        else:
            blocks.append(f"{variant.name}: no trace found")
    return "\n\n".join(blocks)


def run_comparison(args: argparse.Namespace, variants: list[Variant], shared: list[str], preset: Preset | None) -> int:
    results = []
    anchors: dict[str, dict] = {}  # torchtitan runs each of its variants once per call, however many weft rows share it
    for variant in variants:
        weft = run_weft(variant, shared, args.nproc, args.out, args.profile)
        summary = summarize(weft, args.skip)
        anchor = None
        if args.torchtitan_wheels and variant.anchor and preset is not None:
            if not anchors.get(variant.anchor, {}).get("ok"):  # a failed run is tried again for the next row
                anchors[variant.anchor] = run_anchor(variant.anchor, args.anchor_dir, args.torchtitan_wheels,
                                                     preset, args.out, args.profile)
            anchor = anchors[variant.anchor]
        results.append((variant, weft, anchor, summary))
        print(comparison_table([(summary, anchor)]), flush=True)
    table = comparison_table([(s, a) for _, _, a, s in results])
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump([{"weft": s, "torchtitan": a} for _, _, a, s in results], f, indent=1)
    print("\n" + table)
    if args.profile:
        print("\n" + profile_breakdowns([(v, w, a) for v, w, a, _ in results]))
    ok = all(s["ok"] and (a is None or a["ok"]) for _, _, a, s in results)
    return 0 if ok else 1


def run_loss_curve(args: argparse.Namespace, extra: list[str]) -> int:
    """1B flavor, same seed and data, current paths against the pre-issue-10 ones."""
    shared = ["--job.config_file", PRESETS["3b"].config, "--model.flavor", "1B",
              "--training.local_batch_size", "2", "--training.steps", str(args.steps or 200),
              "--lr_scheduler.warmup_steps", "20", "--metrics.no-enable_tensorboard", *extra]
    runs = {}
    # The old paths ran the head, then the loss on its logits.
    for name, script, overrides in (("new_paths", "train.py", []),
                                    ("old_paths", "tests/reference_paths.py", ["--training.head_loss", "separate"])):
        result = run_weft(Variant(name, overrides, None, script), shared, args.nproc, args.out, False)
        if result["returncode"] != 0 or not result["records"]:
            print(f"{name} failed; see {os.path.join(args.out, name + '.log')}")
            return 1
        runs[name] = {r["step"]: r["loss"] for r in result["records"]}
        print(f"{name}: {len(runs[name])} steps in {result['wall_s']:.0f} s", flush=True)
    steps = sorted(set(runs["new_paths"]) & set(runs["old_paths"]))
    rel = {s: abs(runs["new_paths"][s] - runs["old_paths"][s]) / abs(runs["old_paths"][s]) for s in steps}
    worst = max(steps, key=rel.get)
    print("step | old paths loss | new paths loss | relative difference")
    for s in steps:
        if s == 1 or s % 20 == 0 or s == worst:
            print(f"{s} | {runs['old_paths'][s]:.4f} | {runs['new_paths'][s]:.4f} | {100 * rel[s]:.3f}%")
    ok = len(steps) == len(runs["old_paths"]) and rel[worst] <= CURVE_TOLERANCE
    print(f"worst step {worst}: {100 * rel[worst]:.3f}% (tolerance {100 * CURVE_TOLERANCE:.0f}%): "
          f"{'PASS' if ok else 'FAIL'}")
    with open(os.path.join(args.out, "loss_curve.json"), "w") as f:
        json.dump({"steps": steps, **{k: [v[s] for s in steps] for k, v in runs.items()}}, f)
    return 0 if ok else 1


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model size: config, local batch, anchor flavor")
    parser.add_argument("--local-batch", type=int,
                        help="the preset's local batch for both frameworks (e.g. 1 where batch 2 fits no 80 GB GPU)")
    parser.add_argument("--variants", help="comma-separated named variants (default: the preset's)")
    parser.add_argument("--variant", action="append", default=[],
                        help="free-form NAME[@ANCHOR_VARIANT]:--key,value,--key,value (a value may hold commas)")
    parser.add_argument("--torchtitan-wheels", help="the anchor's wheel folder; runs torchtitan beside weft")
    parser.add_argument("--anchor-dir", default=os.path.join(ROOT, ".anchor", "torchtitan"),
                        help="copy of the torchtitan anchor (run.sh, launch.py, tokenizer/)")
    parser.add_argument("--profile", action="store_true", help=f"trace step {PROFILE_STEP}, print kernel breakdown")
    parser.add_argument("--loss-curve", action="store_true", help="1B old-vs-new paths loss curve, 1%% per step")
    parser.add_argument("--steps", type=int, help="training steps (default 15; 200 for --loss-curve)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--out", default="outputs/bench")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the medians")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.loss_curve:
        return run_loss_curve(args, extra)
    preset = PRESETS[args.preset] if args.preset else None
    if args.local_batch is not None:
        if preset is None:
            sys.exit("--local-batch changes a preset's local batch: pass --preset")
        preset = replace(preset, local_batch=args.local_batch)
    if args.torchtitan_wheels and not os.path.isfile(os.path.join(args.anchor_dir, "run.sh")):
        sys.exit(f"no run.sh in {args.anchor_dir}: copy the anchor there "
                 "(cp -r /work/shared/anchors/torchtitan .anchor/) or pass --anchor-dir")
    shared = []
    if preset is not None:
        shared = ["--job.config_file", preset.config, "--training.local_batch_size", str(preset.local_batch),
                  "--checkpoint.enable", "false", "--metrics.no-enable_tensorboard"]
    shared += ["--training.steps", str(args.steps or 15), *extra]
    names = args.variants.split(",") if args.variants else (list(preset.variants) if preset and not args.variant else [])
    variants = [named_variant(n, preset) for n in names] + [free_form_variant(s) for s in args.variant]
    if not variants:
        sys.exit("nothing to run: pass --preset, --variants or --variant (see --help)")
    return run_comparison(args, variants, shared, preset)


if __name__ == "__main__":
    sys.exit(main())
