"""Compile strategies x activation-checkpoint modes x data-parallel engines on the 2x2 mesh
(sequence + loss parallel on), in as few launches as the checks allow.

Every run trains 5 steps with losses and gradient norms within 1e-4 relative of the eager, no-AC `fully_shard`
run on the 2x2 mesh (fp32, same seed and data; the paths differ only in reduction order and
fusion). Whole-model compile picks the graph data-parallel engine ("auto"), so every "model"
run must also be one graph: no graph break or eagerly run frame, one Dynamo graph for model
and loss (one forward and one backward graph), and no recompile after warm-up.

- Launch 1, the cold one (a fresh TORCHINDUCTOR_CACHE_DIR), runs two sets of jobs in turn:
  - inductor: the two configurations users run most, selective-op AC with per-block and with
    whole-model compile; whole-model compile over `fully_shard`'s hooks (many small graphs, the
    configuration that crashed on a warm cache); the memory-budget mode with per-block compile
    (only inductor's partitioner applies a budget). The whole-model graphs are inspected
    (tests/graph_inspection.py): one parameter all-gather per unit (embedding, each block,
    norm + head) in forward, one re-gather and one reduce-scatter per unit in backward, and no
    forward output saved for backward is a gathered parameter.
  - `aot_eager` (Dynamo capture + AOTAutograd, which is where graph breaks, SAC-under-compile
    and DTensor tracing go wrong): the 3 strategies x 4 AC modes matrix, less the two
    selective-op compiled cells, which run through inductor above (a superset); the graph
    engine forced under per-block compile and run eagerly; whole-model compile on 1x4 (dp = 1:
    no data-parallel wrapper at all).
  The two sets share a launch because starting 4 processes costs 20-40 s on 2 cores. The
  inductor jobs come first, in the order launch 2 repeats them: the cache keys name the process
  groups, whose names count the groups created before in the process.
- Launch 2 repeats the inductor jobs (all but the memory-budget run) against the same
  TORCHINDUCTOR_CACHE_DIR, as a user's second run on a machine does, and must train to the
  same losses. Before the cache key named the
  process groups (parallel/compile.py), whole-model compile over fully_shard died there with
  "Could not resolve the process group registered under the name 4": rank 0 loaded a graph
  that rank 2 had written. On torch 2.13 only graphs without a DeviceMesh input are reused
  across processes (a mesh input is hashed with its per-process thread id), so the check that
  the warm launch really loaded graphs from the cache is made on that run, whose small TP-hook
  graphs are such graphs; the graph engine's single graph takes mesh inputs and recompiles.
- Whole-model compile on 2x1 (dp only) trains in a 2-process launch shared with the 2-rank
  meshes of tests/test_parallel_parity.py (the `world2` fixture, tests/conftest.py).

A training process runs one job after another, and compiled code must not outlive the process
groups of an earlier job in the same process (tests/parity_driver.py resets Dynamo between).
"""

import json
from collections import Counter

from tests.test_parallel_parity import BASE, launch

TOLERANCE = 1e-4
AC_MODES = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "sel_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "sel_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}
AOT = ["--compile.backend", "aot_eager"]
STRATEGIES = {
    "none": [],
    "blocks": ["--compile.enable", "--compile.strategy", "blocks", *AOT],
    "model": ["--compile.enable", "--compile.strategy", "model", *AOT],
}
GRAPH_ENGINE = ["--parallelism.data_parallel_engine", "graph"]
MORE_AOT = {
    "graph_engine_blocks/sel_op": STRATEGIES["blocks"] + GRAPH_ENGINE + AC_MODES["sel_op"],
    "graph_engine_eager/sel_op": GRAPH_ENGINE + AC_MODES["sel_op"],
    "model_1x4/sel_op": STRATEGIES["model"] + ["--parallelism.tensor_parallel_degree", "4"] + AC_MODES["sel_op"],
}
INDUCTOR = {
    "blocks_inductor": ["--compile.enable", "--compile.strategy", "blocks", "--compile.backend", "inductor"],
    "model_inductor": ["--compile.enable", "--compile.strategy", "model", "--compile.backend", "inductor"],
    "fully_shard_model_inductor": ["--compile.enable", "--compile.strategy", "model", "--compile.backend", "inductor",
                                   "--parallelism.data_parallel_engine", "fully_shard"],
}
WORLD2 = {"model_2x1/sel_op": STRATEGIES["model"] + ["--parallelism.tensor_parallel_degree", "1"] + AC_MODES["sel_op"]}


def _dp_collectives(graph, op):
    """Per unit, how many `op` collectives run on the data-parallel group."""
    dp_groups = {c["group"] for c in graph["collectives"] if c["op"].startswith("all_gather") and c["unit"] is not None}
    return Counter(c["unit"] for c in graph["collectives"] if c["op"].startswith(op) and c["group"] in dp_groups)


def _check_whole_model_graphs(path):
    with open(path) as f:
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


def test_compile_ac_and_engines_match_eager(tmp_path, corpus, monkeypatch, world2):
    # blocks/sel_op and model/sel_op run through inductor (Dynamo + AOTAutograd + inductor), below.
    runs = {f"{s}/{a}": STRATEGIES[s] + AC_MODES[a] for s in STRATEGIES for a in AC_MODES
            if not (s != "none" and a == "sel_op")}
    runs.update(MORE_AOT)
    inductor_runs = {f"{s}/sel_op": INDUCTOR[s] + AC_MODES["sel_op"] for s in INDUCTOR}
    # The memory budget is applied by inductor's min-cut partitioner only (aot_eager keeps
    # everything), on graphs holding TP collectives and loss-parallel DTensor code.
    inductor_runs["blocks_inductor/memory_budget"] = INDUCTOR["blocks_inductor"] + [
        "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.3"]
    base = BASE + ["--training.dataset_path", corpus, "--parallelism.tensor_parallel_degree", "2"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("WEFT_RECORD_GRAPHS", "1")  # in both launches, so the cache keys agree
    results, cold_cache = launch(tmp_path, 4, base, [*inductor_runs.values(), *runs.values()], cache_stats=True)
    warm_runs = {name: run for name, run in inductor_runs.items() if not name.endswith("memory_budget")}
    warm, warm_cache = launch(tmp_path, 4, base, list(warm_runs.values()), cache_stats=True)
    for name, overrides in inductor_runs.items():
        key = " ".join(overrides)
        assert cold_cache[key].get("autograd_cache_saved", 0) > 0, (name, cold_cache[key])
        if name in warm_runs:
            warm_losses, cold_losses = [r["loss"] for r in warm[key]], [r["loss"] for r in results[key]]
            assert warm_losses == cold_losses, f"{name}: warm-cache losses differ"
    hooks = " ".join(inductor_runs["fully_shard_model_inductor/sel_op"])
    assert warm_cache[hooks].get("autograd_cache_hit", 0) > 0, warm_cache[hooks]
    whole = list(inductor_runs).index("model_inductor/sel_op")
    recorded = sorted(tmp_path.glob(f"world4-*.json.run{whole}/compiled_graphs.json"))
    assert len(recorded) == 2, f"the whole-model inductor runs recorded {len(recorded)} graph files, not 2"
    for path in recorded:  # the cold launch's, and the warm one's (a graph with mesh inputs recompiles)
        _check_whole_model_graphs(path)

    runs.update(inductor_runs)
    results.update(world2)
    runs.update(WORLD2)
    reference = results[" ".join(runs["none/none"])]
    assert reference[-1]["loss"] < reference[0]["loss"]
    failures = []
    for name, overrides in runs.items():
        records = results[" ".join(overrides)]
        assert [r["step"] for r in records] == list(range(1, 6)), name
        for key in ("loss", "grad_norm"):
            worst = max(abs(r[key] - ref[key]) / abs(ref[key]) for r, ref in zip(records, reference))
            if worst >= TOLERANCE:
                failures.append(f"{name}: {key} max rel diff {worst:.2e}")
        last = records[-1]
        graphs = (last.get("graph_breaks"), last.get("unique_graphs"), last.get("recompiles_after_warmup"))
        if name.startswith("model") and graphs != (0, 1, 0):
            failures.append(f"{name}: (graph breaks, unique graphs, recompiles after warm-up) = {graphs}")
    assert not failures, failures
