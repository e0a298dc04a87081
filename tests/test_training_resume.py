"""Checkpointing through the real trainer: exact resume, resharding, preemption, NaN stop, export.

Resumed runs on dp 1, 2 and 4 must also train on exactly the global batches of the straight
run (hashes recorded by tests/parity_driver.py).

All runs use the tiny model in fp32 on CPU/gloo with a constant LR after a 2-step warm-up, so
a run cut at step 10 and resumed to 20 follows the same schedule as an uninterrupted 20-step run.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import ROOT, run_distributed
from tests.test_parallel_parity import BASE, launch

RESUME = BASE + [
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
    "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval", "10",
]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager", "--compile.strategy", "model"]


def losses(records):
    return {r["step"]: r["loss"] for r in records}


def test_exact_resume_and_reshard(tmp_path, corpus):
    base = RESUME + ["--training.dataset_path", corpus]
    ckpt = str(tmp_path / "ckpt_2x2")
    straight = ["--training.steps", "20", "--parallelism.tensor_parallel_degree", "2", *COMPILED,
                "--checkpoint.folder", str(tmp_path / "ckpt_straight")]
    first_half = ["--training.steps", "10", "--parallelism.tensor_parallel_degree", "2", *COMPILED,
                  "--checkpoint.folder", ckpt]
    # dp = 1 (pure TP): parameters without any data-parallel wrapper, saved as tp DTensors.
    first_half_dp1 = ["--training.steps", "10", "--parallelism.tensor_parallel_degree", "4",
                      "--checkpoint.folder", str(tmp_path / "resume_2x2_from_1x4")]
    results = launch(tmp_path, 4, base, [straight, first_half, first_half_dp1])
    reference = losses(results[" ".join(straight)])
    straight_batches = results["batches " + " ".join(straight)]
    assert sorted(os.listdir(ckpt)) == ["step-10"]
    for name in ("resume_2x2", "resume_4x1", "resume_1x4", "resume_1x1"):
        shutil.copytree(ckpt, tmp_path / name)

    def resumed(name, tp, compiled=()):
        return ["--training.steps", "20", "--parallelism.tensor_parallel_degree", str(tp), *compiled,
                "--checkpoint.folder", str(tmp_path / name)]

    runs = {"2x2": resumed("resume_2x2", 2, COMPILED), "4x1": resumed("resume_4x1", 1), "1x4": resumed("resume_1x4", 4),
            "2x2 from 1x4": resumed("resume_2x2_from_1x4", 2)}
    results = launch(tmp_path, 4, base, list(runs.values()))
    # -1: the global batch comes from the checkpoint (8), so one rank runs 4 micro-batches of 2.
    runs["1x1"] = resumed("resume_1x1", 1) + ["--training.global_batch_size", "-1"]
    results.update(launch(tmp_path, 1, base, [runs["1x1"]]))

    exact = losses(results[" ".join(runs["2x2"])])
    assert sorted(exact) == list(range(11, 21)), "the resumed run starts at step 11"
    assert [exact[s] for s in range(11, 21)] == [reference[s] for s in range(11, 21)], "bitwise-equal losses"
    assert len(straight_batches) == 20 and len(set(straight_batches.values())) == 20
    for mesh in ("2x2", "4x1", "1x4", "1x1"):  # dp 2, 4, 1, 1: the same global samples from the memory-mapped store
        resumed_batches = results["batches " + " ".join(runs[mesh])]
        assert resumed_batches == {str(s): straight_batches[str(s)] for s in range(11, 21)}, mesh
    for mesh in ("4x1", "1x4", "1x1", "2x2 from 1x4"):
        got = losses(results[" ".join(runs[mesh])])
        for step in range(11, 21):
            rel = abs(got[step] - reference[step]) / reference[step]
            assert rel < 1e-5, f"{mesh} step {step}: {got[step]} vs {reference[step]}"


def test_sigterm_saves_and_exits_zero(tmp_path, corpus):
    dump = tmp_path / "run"
    cmd = [sys.executable, "train.py", *RESUME, "--training.dataset_path", corpus, "--training.steps", "100000",
           "--checkpoint.interval", "100000", "--job.dump_folder", str(dump)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = dump / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(dump / "checkpoint") if not d.endswith(".tmp"))
    last_logged = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert saved and saved[-1] >= 3 and saved[-1] >= last_logged
    assert "preemption requested (SIGTERM)" in out


def _nan_at_step(rank, world_size, dump, corpus, bad_step):
    from trainer.config import load_config
    from trainer.errors import NonFiniteError
    from trainer.run import resolve_run
    from trainer.trainer import Trainer

    cfg = load_config(RESUME + ["--training.dataset_path", corpus, "--training.steps", "6",
                                "--checkpoint.interval", "1", "--job.dump_folder", dump])
    trainer = Trainer(resolve_run(cfg, world_size))
    clean_loss = trainer.loss_fn

    def poisoned(logits, labels):
        loss = clean_loss(logits, labels)
        return loss * float("nan") if trainer.step == bad_step else loss

    trainer.loss_fn = poisoned
    with pytest.raises(NonFiniteError, match=f"step {bad_step}"):
        trainer.train()
    trainer.close()


def test_nan_stops_before_saving_poisoned_state(tmp_path, corpus):
    dump = str(tmp_path / "nan")
    run_distributed(_nan_at_step, 1, dump, corpus, 4)
    saved = sorted(os.listdir(os.path.join(dump, "checkpoint")))
    assert saved == ["step-1", "step-2", "step-3"]


def test_export_at_end(tmp_path, corpus):
    from safetensors.torch import load_file

    dump = tmp_path / "export"
    proc = subprocess.run([sys.executable, "train.py", *RESUME, "--training.dataset_path", corpus,
                           "--training.steps", "2", "--checkpoint.export_hf", "--job.dump_folder", str(dump)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tensors = load_file(str(dump / "checkpoint" / "hf" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (100277, 64)  # padding rows trimmed
    assert "model.layers.1.mlp.down_proj.weight" in tensors
    config = json.loads((dump / "checkpoint" / "hf" / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
