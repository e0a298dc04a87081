"""Kernel-time breakdown of a torch.profiler Chrome trace: milliseconds per step by category.

    python scripts/trace_summary.py TRACE.json [LABEL=TRACE.json ...]

GPU traces: every kernel, memcpy and memset is put in one category by its name; its device
time is summed (collectives on their own stream overlap compute, so the categories can add
up to more than the busy time, which is reported separately as the union of all intervals).
CPU-only traces (no device events): each `aten::` op's self time (its time minus that of the
ops it called) is classified by the op's name instead.

Names are matched as torch 2.11 and cuBLAS/cuDNN/NCCL/inductor spell them; inductor's Triton
kernels are named after the aten ops they fuse: a kernel that only moves data (copies, casts,
views, concatenation, fills) counts as copies+casts, one that also computes as
norm+pointwise, a template kernel (`triton_tem_`) as matmul.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict

CATEGORIES = ("matmul", "attention", "norm+pointwise", "copies+casts", "collectives", "optimizer", "other")

_COLLECTIVE = ("nccl", "c10d", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
               "reducescatter", "broadcast", "all_to_all")
_ATTENTION = ("flash", "fmha", "sdpa", "attention", "scaled_dot_product")
_MATMUL = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "splitk")
_COPY = ("copy", "memcpy", "memset", "fill", "cat_", "catarray", "chunk_cat", "cast", "transpose", "permute")
_POINTWISE = ("elementwise", "norm", "reduce", "softmax", "nll", "cross_entropy", "silu", "mul", "add", "exp",
              "rsqrt", "pow", "where", "mean", "sum", "max", "div", "sub", "neg", "masked")
# Aten ops (and inductor fused-op tokens) that only move or reinterpret data.
_DATA_MOVEMENT = ("scaled_dot_product_cudnn_attention", "scaled_dot_product_flash_attention",
                  "scaled_dot_product_efficient_attention", "_to_copy", "to_copy", "copy", "clone",
                  "_unsafe_view", "unsafe_view", "view", "expand", "cat", "stack", "permute", "transpose",
                  "slice", "select", "split_with_sizes", "split", "unsqueeze", "squeeze", "reshape", "alias",
                  "constant_pad_nd", "flip", "repeat_interleave", "repeat", "zeros", "full", "fill", "zero",
                  "contiguous", "to", "t", "empty", "new_zeros")
_ATEN_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"}
_ATEN_OPTIMIZER = ("_foreach_", "_fused_adam", "adam")


def _only_moves_data(ops: str) -> bool:
    """Whether an underscore-joined list of aten op names (an inductor kernel's fused ops)
    consists of data-movement ops alone."""
    rest = "_" + re.sub(r"_\d+$", "", ops) + "_"
    for token in sorted(_DATA_MOVEMENT, key=len, reverse=True):
        while f"_{token}_" in rest:
            rest = rest.replace(f"_{token}_", "_")
    return rest.strip("_") == ""


def _classify_aten(op: str) -> str:
    if any(k in op for k in _COLLECTIVE):
        return "collectives"
    if "scaled_dot_product" in op or "attention" in op:
        return "attention"
    if op in _ATEN_MATMUL:
        return "matmul"
    if any(k in op for k in _ATEN_OPTIMIZER):
        return "optimizer"
    if _only_moves_data(op):
        return "copies+casts"
    return "norm+pointwise"


def classify(name: str) -> str:
    """The category of one GPU kernel name or one CPU op name (`aten::mm`, `c10d::...`)."""
    lower = name.lower()
    if name.startswith("aten::"):
        return _classify_aten(name[len("aten::"):])
    if any(k in lower for k in _COLLECTIVE):
        return "collectives"
    if lower.startswith("triton_"):
        kind, _, ops = lower.partition("_fused_")
        if kind.endswith("_tem"):
            return "attention" if "attention" in ops else "matmul"
        return "copies+casts" if _only_moves_data(ops) else "norm+pointwise"
    if any(k in lower for k in _ATTENTION):
        return "attention"
    if "multi_tensor_apply" in lower or "lpnorm" in lower or "adam" in lower:
        return "copies+casts" if "copy" in lower else "optimizer"
    if any(k in lower for k in _MATMUL) or re.search(r"\bsm\d+_", lower):
        return "matmul"
    if any(k in lower for k in _COPY):
        return "copies+casts"
    if any(k in lower for k in _POINTWISE):
        return "norm+pointwise"
    return "other"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _self_times(ops: list[dict]) -> list[tuple[str, float]]:
    """(name, self time in us) of CPU ops: nested ops on one thread are subtracted from
    the op that encloses them."""
    out = []
    by_thread: dict[object, list[dict]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [end, name, dur, children]
        for e in events:
            while stack and stack[-1][0] <= e["ts"]:
                end, name, dur, children = stack.pop()
                out.append((name, dur - children))
            if stack:
                stack[-1][3] += e["dur"]
            stack.append([e["ts"] + e["dur"], e["name"], e["dur"], 0.0])
        out.extend((name, dur - children) for _, name, dur, children in stack)
    return out


def summarize(path: str) -> dict:
    """{"device", "steps", "step_ms", "busy_ms", "ms": {category: ms per step}} of one trace."""
    with open(path) as f:
        data = json.load(f)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data)
              if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    n_steps = max(len({e["name"] for e in steps}), 1)
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    ms: dict[str, float] = {c: 0.0 for c in CATEGORIES}
    if device:
        for e in device:
            ms[classify(e["name"])] += e["dur"]
        busy = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in device])
    else:
        for name, self_us in _self_times([e for e in events if e.get("cat") == "cpu_op"]):
            ms[classify(name) if name.startswith("aten::") or "c10d" in name else "other"] += self_us
        busy = sum(ms.values())
    return {
        "device": "gpu" if device else "cpu",
        "steps": n_steps,
        "step_ms": sum(e["dur"] for e in steps) / n_steps / 1000,
        "busy_ms": busy / n_steps / 1000,
        "ms": {c: v / n_steps / 1000 for c, v in ms.items()},
    }


def format_breakdown(summaries: dict[str, dict]) -> str:
    """One column per labelled summary, one row per category, in ms per step."""
    labels = list(summaries)
    rows = [("category", *labels)]
    rows += [(c, *(f"{summaries[label]['ms'][c]:.1f}" for label in labels)) for c in CATEGORIES]
    rows.append(("sum of categories", *(f"{sum(summaries[label]['ms'].values()):.1f}" for label in labels)))
    rows.append(("busy (union)", *(f"{summaries[label]['busy_ms']:.1f}" for label in labels)))
    rows.append(("step wall", *(f"{summaries[label]['step_ms']:.1f}" for label in labels)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    summaries = {}
    for arg in argv:
        label, _, path = arg.rpartition("=") if "=" in arg else (arg, "", arg)
        summaries[label] = summarize(path)
    print(format_breakdown(summaries) + "  (ms per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
