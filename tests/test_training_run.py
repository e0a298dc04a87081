"""A single-process run as a user launches it: metric lines, metrics.jsonl, TensorBoard, traces."""

import json
import os
import subprocess
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.dist_utils import ROOT


def test_single_process_run_logs_everywhere(tmp_path, corpus):
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "--job.config_file", "train_configs/debug_model.toml",
         "--model.flavor", "tinymodel", "--training.seq_len", "32", "--training.dataset_path", corpus,
         "--training.steps", "5", "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
         "--profiling.enable_profiling", "--profiling.profile_freq", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metric_lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(metric_lines) == 5
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["mfu"] is None  # no peak-FLOPs figure for a CPU
    (event_dir,) = {os.path.dirname(p) for p in map(str, (dump / "tb").rglob("events.*"))}
    acc = EventAccumulator(event_dir)
    acc.Reload()
    for tag in ("loss/loss", "loss/grad_norm", "loss/lr", "throughput/tps", "throughput/tflops",
                "throughput/step_time_s", "memory/memory_max_active_gib"):
        assert tag in acc.Tags()["scalars"], tag
        assert len(acc.Scalars(tag)) == 5
    assert "config/text_summary" in acc.Tags()["tensors"]  # the resolved config as a text entry
    assert (dump / "config.toml").exists()
    assert (dump / "profile_traces" / "iteration_4" / "rank0_trace.json").exists()
