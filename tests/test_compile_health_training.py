"""Compile health through the real trainer: compilation happens once.

After the warm-up, a steady-state run (with validation every few steps, which switches grad
mode) must show zero recompiles in metrics.jsonl under both compile strategies.
"""

from tests.test_parallel_parity import BASE, launch

STEADY = BASE + ["--training.steps", "12", "--compile.enable", "--compile.backend", "aot_eager",
                 "--compile.warmup_steps", "2", "--validation.enable", "--validation.freq", "5",
                 "--validation.steps", "1"]


def test_no_recompiles_after_warmup_for_both_strategies(tmp_path, corpus):
    runs = [["--compile.strategy", "blocks"], ["--compile.strategy", "model"]]
    results = launch(tmp_path, 1, STEADY + ["--training.dataset_path", corpus], runs)
    for run in runs:
        records = [r for r in results[" ".join(run)] if "loss" in r]
        steady = [r for r in records if r["step"] > 2]
        assert len(steady) == 10, run
        assert all(r["recompiles_after_warmup"] == 0 for r in steady), [r["recompiles_after_warmup"] for r in steady]
        assert len({r["recompiles"] for r in steady}) == 1, "cumulative recompiles must not grow after warm-up"
        assert records[0]["unique_graphs"] >= 1  # something was compiled
        validation = [r for r in results[" ".join(run)] if "validation/loss" in r]
        assert [r["step"] for r in validation] == [5, 10, 12]
