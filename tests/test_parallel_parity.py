"""2-D parallel parity: every mesh trains the same sequences to the same numbers as 1 process.

The tiny model (real cl100k vocabulary, padded to 100,352 rows) trains 5 steps in fp32
at a fixed global batch on meshes 1x1 (reference), 2x1, 1x2, 2x2 and 1x4, with sequence
parallel and loss parallel on and off. Tolerance: 1e-5 relative on every step's loss and
gradient norm (fp32; differences come only from reduction order).
"""

import json
import subprocess
import sys

import pytest

from tests.dist_utils import ROOT, free_port, multi_rank_env

TOLERANCE = 1e-5

BASE = [
    "--job.config_file", "train_configs/debug_model.toml",
    "--model.flavor", "tinymodel",
    "--training.seq_len", "32",
    "--training.global_batch_size", "8",
    "--training.local_batch_size", "2",
    "--training.steps", "5",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--optimizer.lr", "0.01",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.no-enable_tensorboard",
]

TP_VARIANTS = [
    ["--parallelism.enable_sequence_parallel", "true", "--parallelism.enable_loss_parallel", "true"],
    ["--parallelism.enable_sequence_parallel", "true", "--parallelism.enable_loss_parallel", "false"],
    ["--parallelism.enable_sequence_parallel", "false", "--parallelism.enable_loss_parallel", "true"],
    ["--parallelism.enable_sequence_parallel", "false", "--parallelism.enable_loss_parallel", "false"],
]

# Trained in a 2-process launch shared with tests/test_compile_parity.py (the `world2` fixture, tests/conftest.py).
WORLD2_MESHES = [["--parallelism.tensor_parallel_degree", "1"]]
WORLD2_MESHES += [["--parallelism.tensor_parallel_degree", "2", *v] for v in TP_VARIANTS]


def launch(tmp_path, nproc, base, runs, *, cache_stats=False):
    """Train `runs` in one torchrun launch; returns {run: metrics records} (and, with
    cache_stats, rank 0's compile-cache hit/miss counts per run as a second value)."""
    out = tmp_path / f"world{nproc}-{len(list(tmp_path.glob('world*.json')))}.json"
    args = [str(out), *base]
    for run in runs:
        args += ["--", *run]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "tests/parity_driver.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=multi_rank_env())
    if proc.returncode != 0:
        output = proc.stdout + proc.stderr
        errors = [line for line in output.splitlines() if "Error" in line and "ChildFailed" not in line]
        pytest.fail("launch failed:\n" + "\n".join(errors[:10]) + "\n---\n" + _fatal_stacks(output)
                    + "\n---\n" + output[-3000:])
    with open(out) as f:
        results = json.load(f)
    if not cache_stats:
        return results
    with open(f"{out}.cache.json") as f:
        return results, json.load(f)


def _fatal_stacks(output: str, lines_each: int = 40) -> str:
    """The faulthandler reports in a launch's output ("Fatal Python error: ..." and the stacks under it)."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if "Fatal Python error" in line]
    return "\n".join("\n".join(lines[i:i + lines_each]) for i in starts)


def assert_close_runs(reference, other, label):
    assert [r["step"] for r in other] == [1, 2, 3, 4, 5], label
    for ref, got in zip(reference, other):
        for key in ("loss", "grad_norm"):
            rel = abs(got[key] - ref[key]) / abs(ref[key])
            assert rel < TOLERANCE, f"{label} step {ref['step']} {key}: {got[key]} vs {ref[key]} (rel {rel:.2e})"


@pytest.fixture(scope="module")
def reference(references):
    losses = [r["loss"] for r in references[8]]
    assert losses[-1] < losses[0]  # it trains
    return references[8]


def test_world2_meshes(world2, reference):
    for run in WORLD2_MESHES:
        assert_close_runs(reference, world2[" ".join(run)], f"world 2 {' '.join(run)}")


def test_world4_meshes(tmp_path, corpus, reference):
    runs = [["--parallelism.tensor_parallel_degree", "2", *v] for v in TP_VARIANTS]
    runs += [["--parallelism.tensor_parallel_degree", "4", *v] for v in TP_VARIANTS]
    results = launch(tmp_path, 4, BASE + ["--training.dataset_path", corpus], runs)
    for run in runs:
        assert_close_runs(reference, results[" ".join(run)], f"world 4 {' '.join(run)}")
