"""Compile strategies x activation-checkpoint modes on the 2x2 mesh (sequence + loss parallel on).

Every combination trains 5 steps with losses within 1e-4 relative of the eager, no-AC run on the
same mesh (fp32, same seed and data). Whole-model compile picks the graph data-parallel engine
("auto"), so every "model" run must also be one graph: no graph break or eager frame, one
Dynamo graph for model and loss. The full 3 x 4 matrix runs with the `aot_eager` backend
(Dynamo capture + AOTAutograd, which is where graph breaks, SAC-under-compile and DTensor tracing
go wrong); the two configurations users run most, selective-op AC with per-block and with
whole-model compile, also run through inductor, as does the memory-budget mode with per-block
compile (only inductor's partitioner applies a budget). One 4-process launch runs the aot_eager
matrix, a second one the inductor runs with a fresh inductor cache: a training process runs
one job, and compiled code must not outlive the process groups of an earlier job in the same
process.

Warm cache: a third launch repeats the inductor runs against the same TORCHINDUCTOR_CACHE_DIR,
as a user's second run on a machine does, and must train to the same losses. Before the cache
key named the process groups (parallel/compile.py), whole-model compile over fully_shard died
there with "Could not resolve the process group registered under the name 4": rank 0 loaded a
graph that rank 2 had written. On torch 2.13 only graphs without a DeviceMesh input are reused
across processes (a mesh input is hashed with its per-process thread id), so the check that
the warm launch really loaded graphs from the cache is made on that run, whose small TP-hook
graphs are such graphs; the graph engine's single graph takes mesh inputs and recompiles.
"""


from tests.test_parallel_parity import BASE, launch

TOLERANCE = 1e-4
AC_MODES = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "sel_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "sel_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
}
STRATEGIES = {
    "none": [],
    "blocks": ["--compile.enable", "--compile.strategy", "blocks", "--compile.backend", "aot_eager"],
    "model": ["--compile.enable", "--compile.strategy", "model", "--compile.backend", "aot_eager"],
}
INDUCTOR = {
    "blocks_inductor": ["--compile.enable", "--compile.strategy", "blocks", "--compile.backend", "inductor"],
    "model_inductor": ["--compile.enable", "--compile.strategy", "model", "--compile.backend", "inductor"],
    # Whole-model compile over FSDP2's hooks: many small graphs, the configuration that crashed
    # on a warm cache.
    "fully_shard_model_inductor": ["--compile.enable", "--compile.strategy", "model", "--compile.backend", "inductor",
                                   "--parallelism.data_parallel_engine", "fully_shard"],
}


def test_compile_and_ac_matrix_matches_eager(tmp_path, corpus, monkeypatch):
    runs = {f"{s}/{a}": STRATEGIES[s] + AC_MODES[a] for s in STRATEGIES for a in AC_MODES}
    base = BASE + ["--training.dataset_path", corpus, "--parallelism.tensor_parallel_degree", "2"]
    results = launch(tmp_path, 4, base, list(runs.values()))
    inductor_runs = {f"{s}/sel_op": INDUCTOR[s] + AC_MODES["sel_op"] for s in INDUCTOR}
    # The memory budget is applied by inductor's min-cut partitioner only (aot_eager keeps
    # everything), on graphs holding TP collectives and loss-parallel DTensor code.
    inductor_runs["blocks_inductor/memory_budget"] = INDUCTOR["blocks_inductor"] + [
        "--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0.3"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    cold, cold_cache = launch(tmp_path, 4, base, list(inductor_runs.values()), cache_stats=True)
    warm, warm_cache = launch(tmp_path, 4, base, list(inductor_runs.values()), cache_stats=True)
    for name, overrides in inductor_runs.items():
        key = " ".join(overrides)
        assert cold_cache[key].get("autograd_cache_saved", 0) > 0, (name, cold_cache[key])
        assert [r["loss"] for r in warm[key]] == [r["loss"] for r in cold[key]], f"{name}: warm-cache losses differ"
    hooks = " ".join(inductor_runs["fully_shard_model_inductor/sel_op"])
    assert warm_cache[hooks].get("autograd_cache_hit", 0) > 0, warm_cache[hooks]
    results.update(cold)
    runs.update(inductor_runs)
    reference = [r["loss"] for r in results[" ".join(runs["none/none"])]]
    assert reference[-1] < reference[0]
    failures = []
    for name, overrides in runs.items():
        losses = [r["loss"] for r in results[" ".join(overrides)]]
        assert len(losses) == 5, name
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        if worst >= TOLERANCE:
            failures.append(f"{name}: max rel diff {worst:.2e}")
        last = results[" ".join(overrides)][-1]
        if name.startswith("model") and (last["graph_breaks"], last["unique_graphs"]) != (0, 1):
            failures.append(f"{name}: {last['graph_breaks']} graph breaks, {last['unique_graphs']} graphs")
    assert not failures, failures
