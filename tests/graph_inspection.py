"""What a compiled graph holds, for tests: its collectives and the tensors it saves for backward.

`record_compiled_graphs(path)` wraps the post-grad pass the graph data-parallel engine
installed, so every graph inductor compiles is summarized right after the engine's
bucketing: each collective with its process group and unit, and, for forward graphs, every
output (the loss and the tensors saved for backward) with whether it is computed from
parameter gathers alone, i.e. a gathered parameter kept until backward.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import fx

from parallel import torch_internals
from parallel.graph_data_parallel import UNIT_KEY, parameter_derived

_COLLECTIVE_NAMESPACE = "_c10d_functional"


def _group(node: fx.Node) -> str:
    return [a for a in node.args if isinstance(a, str)][-1]


def summarize(graph: fx.Graph) -> dict[str, Any]:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    phase = "backward" if any(n.name.startswith("tangents") for n in placeholders) else "forward"
    collectives = [
        {"op": n.target._opname, "group": _group(n), "unit": torch_internals.annotation(n, UNIT_KEY)}
        for n in graph.nodes
        if n.op == "call_function" and getattr(n.target, "namespace", None) == _COLLECTIVE_NAMESPACE
        and n.target._opname != "wait_tensor"
    ]
    summary = {"phase": phase, "collectives": collectives}
    if phase == "forward":
        derived = parameter_derived(graph)
        (outputs,) = [n.args[0] for n in graph.nodes if n.op == "output"]
        summary["outputs"] = [
            {
                "name": n.name,
                "op": str(n.target),
                "shape": list(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None,
                "parameter_derived": n in derived,
            }
            for n in outputs
            if isinstance(n, fx.Node)
        ]
    return summary


def record_compiled_graphs(path: str) -> Any:
    """Start recording into `path` (JSON list, rewritten after every graph); returns the pass
    that was installed before, to put back with `torch._inductor.config.post_grad_custom_post_pass`."""
    engine_pass = torch._inductor.config.post_grad_custom_post_pass
    if engine_pass is None:
        return None
    records: list[dict[str, Any]] = []

    def run_and_record(graph: fx.Graph) -> None:
        engine_pass(graph)
        records.append(summarize(graph))
        with open(path, "w") as f:
            json.dump(records, f)

    torch._inductor.config.post_grad_custom_post_pass = torch_internals.make_post_grad_pass(
        run_and_record, uuid=f"{engine_pass.uuid()}-recorded"
    )
    return engine_pass
