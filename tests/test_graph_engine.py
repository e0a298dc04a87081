"""The graph data-parallel engine through the real trainer (CPU, gloo, tiny model, fp32).

Reference: `fully_shard`, eager, op-level SAC, 2x2 mesh with sequence and loss parallel, 10
steps. Against it, within 1e-4 relative on every step's loss and gradient norm (the tolerance
of the other compile tests; the paths differ only in reduction order and fusion):

- the headline run: whole-model compile with the graph engine through inductor, same mesh
  and AC. Compile health must report no graph break and no eagerly run frame, one Dynamo
  graph (model and loss together: one forward and one backward graph), and no recompile
  after warm-up. Its compiled graphs are inspected (tests/graph_inspection.py): one
  parameter all-gather per unit (embedding, each block, norm + head) in forward, one
  re-gather and one reduce-scatter per unit in backward, and no forward output saved for
  backward is a gathered parameter;
- whole-model compile on 1x4 (dp = 1: no data-parallel wrapper at all) and on 2x1, op SAC;
- per-block compile with the graph engine, and the graph engine run eagerly.

Full AC and every other AC mode with whole-model compile (the graph engine, by "auto") run
in tests/test_compile_parity.py; checkpoints across engines in tests/test_training_resume.py.
"""

import json
import os
from collections import Counter

from tests.test_parallel_parity import BASE, launch

TOLERANCE = 1e-4
STEPS = ["--training.steps", "10", "--compile.warmup_steps", "2"]
OP_SAC = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]
WHOLE = ["--compile.enable", "--compile.strategy", "model", "--parallelism.data_parallel_engine", "graph"]
AOT = ["--compile.backend", "aot_eager"]
RUNS = {
    "reference": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_engine", "fully_shard"],
    "whole 2x2 inductor": ["--parallelism.tensor_parallel_degree", "2", *WHOLE, "--compile.backend", "inductor"],
    "whole 1x4": ["--parallelism.tensor_parallel_degree", "4", *WHOLE, *AOT],
    "blocks 2x2": ["--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.strategy", "blocks",
                   "--parallelism.data_parallel_engine", "graph", *AOT],
    "eager 2x2": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_engine", "graph"],
}
WORLD2 = {"whole 2x1": ["--parallelism.tensor_parallel_degree", "1", *WHOLE, *AOT]}


def _close(reference, records, name):
    assert [r["step"] for r in records] == list(range(1, 11)), name
    for ref, got in zip(reference, records):
        for key in ("loss", "grad_norm"):
            rel = abs(got[key] - ref[key]) / abs(ref[key])
            assert rel < TOLERANCE, f"{name} step {ref['step']} {key}: {got[key]} vs {ref[key]} (rel {rel:.2e})"


def _dp_collectives(graph, op):
    """Per unit, how many `op` collectives run on the data-parallel group."""
    dp_groups = {c["group"] for c in graph["collectives"] if c["op"].startswith("all_gather") and c["unit"] is not None}
    return Counter(c["unit"] for c in graph["collectives"] if c["op"].startswith(op) and c["group"] in dp_groups)


def test_graph_engine(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("WEFT_RECORD_GRAPHS", "1")
    base = BASE + ["--training.dataset_path", corpus, *STEPS, *OP_SAC]
    results = launch(tmp_path, 4, base, list(RUNS.values()))
    results.update(launch(tmp_path, 2, base, list(WORLD2.values())))
    runs = {**RUNS, **WORLD2}
    records = {name: [r for r in results[" ".join(run)] if "loss" in r] for name, run in runs.items()}
    reference = records.pop("reference")
    assert reference[-1]["loss"] < reference[0]["loss"]
    for name, got in records.items():
        _close(reference, got, name)
        if name.startswith("whole"):
            last = got[-1]
            assert last["graph_breaks"] == 0, (name, last)  # counts eagerly run frames too
            assert last["unique_graphs"] == 1, (name, last)
            assert last["recompiles_after_warmup"] == 0, (name, last)

    folder = f"{tmp_path}/world4-0.json.run1"  # the inductor run
    with open(os.path.join(folder, "compiled_graphs.json")) as f:
        graphs = json.load(f)
    assert [g["phase"] for g in graphs] == ["forward", "backward"], "model + loss: one forward, one backward graph"
    forward, backward = graphs
    # tinymodel's units: 0 the embedding, 1 and 2 the blocks, 3 norm + head.
    assert _dp_collectives(forward, "all_gather") == {0: 1, 1: 1, 2: 1, 3: 1}
    # Reshard after forward: backward gathers the blocks and the head again (the embedding's
    # backward needs no weight).
    assert _dp_collectives(backward, "all_gather") == {1: 1, 2: 1, 3: 1}
    assert _dp_collectives(backward, "reduce_scatter") == {0: 1, 1: 1, 2: 1, 3: 1}
    outputs = forward["outputs"]
    assert len(outputs) > 1, "the forward returns the loss and the tensors saved for backward"
    gathered = [o for o in outputs if o["parameter_derived"]]
    assert not gathered, f"gathered parameters saved for backward: {gathered}"
