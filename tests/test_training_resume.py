"""Checkpointing through the real trainer: exact resume, resharding, preemption, NaN stop, export.

All runs use the tiny model in fp32 on CPU/gloo with a constant LR after a 2-step warm-up, so
a run cut at step 4 and resumed to 8 follows the same schedule as an uninterrupted 8-step run.
Resumed runs on dp 1, 2 and 4 must also train on exactly the global batches of the straight
run (hashes recorded by tests/parity_driver.py). The cut comes after the warm-up, with Adam's
moments and the data position past their first steps; more steps would only repeat the
same checks, at 1.5 s a step for each of 9 four-process runs on 2 cores.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.dist_utils import ROOT, run_distributed
from tests.test_parallel_parity import BASE, launch

CUT, END = 4, 8  # save at CUT, resume to END
RESUME = BASE + [
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "constant",
    "--training.deterministic", "--checkpoint.enable", "--checkpoint.interval", str(CUT),
]
GRAPH = ["--parallelism.data_parallel_engine", "graph"]
FULLY_SHARD = ["--parallelism.data_parallel_engine", "fully_shard"]
COMPILED = ["--compile.enable", "--compile.backend", "aot_eager", "--compile.strategy", "model", *GRAPH]
OVERLAP = ["--optimizer.overlap_step", "on"]  # trainer/overlapped_step.py, run in place on a CPU


def losses(records):
    return {r["step"]: r["loss"] for r in records}


def test_exact_resume_and_reshard(tmp_path, corpus):
    """Saved at step 4, resumed to 8, against an uninterrupted 8-step run (whole-model compile,
    graph engine, 2x2): bitwise equal on the same mesh and engine, within 1e-5 relative after
    resharding to another mesh, engine or the dp = 1 path.

    Engines: the graph engine's 2x2 checkpoint resumes under fully_shard on 4x1, and a
    fully_shard 2x2 checkpoint under the graph engine on 4x1. dp = 1: the 2x2 checkpoint
    resumes on 1x4 and 1x1 (no data-parallel wrapper; on 1x1 with global_batch_size -1, which takes
    the checkpoint's global batch), and a 1x4 checkpoint resumes on 2x2. The dp = 1 runs step
    unit by unit (optimizer.overlap_step), so a save right after such a step, and steps after a
    resume, are checked too. Every resumed step trains on the straight run's global batch (a
    hash of its rows)."""
    base = RESUME + ["--training.dataset_path", corpus]

    def run(steps, tp, folder, *extra):
        return ["--training.steps", str(steps), "--parallelism.tensor_parallel_degree", str(tp), *extra,
                "--checkpoint.folder", str(tmp_path / folder)]

    straight = run(END, 2, "ckpt_straight", *COMPILED)
    saved = {  # folder the first half saves into -> how it is trained
        "graph_2x2": run(CUT, 2, "graph_2x2", *COMPILED),
        "fully_shard_2x2": run(CUT, 2, "fully_shard_2x2", *FULLY_SHARD),
        "dp1_1x4": run(CUT, 4, "dp1_1x4", *OVERLAP),
    }
    resumes = {  # name -> (checkpoint it starts from, mesh tp degree, overrides)
        "2x2 graph, exact": ("graph_2x2", 2, COMPILED),
        "4x1 fully_shard from graph": ("graph_2x2", 1, FULLY_SHARD),
        "4x1 graph from fully_shard": ("fully_shard_2x2", 1, COMPILED),
        "1x4 dp=1 from graph": ("graph_2x2", 4, OVERLAP),
        "2x2 from dp=1": ("dp1_1x4", 2, FULLY_SHARD),
        "1x1 dp=1 from graph": ("graph_2x2", 1, OVERLAP),
    }
    # Each resume loads step CUT of the folder it starts from, and its own last save (step END)
    # lands there too: so the 4-process resumes train in the launch that writes their checkpoints
    # (a launch costs 20-40 s on 2 cores).
    runs = {name: run(END, tp, source, *extra, "--checkpoint.load_step", str(CUT))
            for name, (source, tp, extra) in resumes.items()}
    # -1: the global batch comes from the checkpoint (8), so one rank runs 4 micro-batches of 2.
    runs["1x1 dp=1 from graph"] += ["--training.global_batch_size", "-1"]
    single = "1x1 dp=1 from graph"
    results = launch(tmp_path, 4, base, [straight, *saved.values(), *(r for name, r in runs.items() if name != single)])
    results.update(launch(tmp_path, 1, base, [runs[single]]))
    reference = losses(results[" ".join(straight)])
    straight_batches = results["batches " + " ".join(straight)]
    assert len(straight_batches) == END and len(set(straight_batches.values())) == END
    for folder in saved:  # the first half saved at CUT, the runs resumed from it at END
        assert set(os.listdir(tmp_path / folder)) == {f"step-{CUT}", f"step-{END}"}, folder

    exact = losses(results[" ".join(runs["2x2 graph, exact"])])
    resumed = range(CUT + 1, END + 1)
    assert sorted(exact) == list(resumed), f"the resumed run starts at step {CUT + 1}"
    assert [exact[s] for s in resumed] == [reference[s] for s in resumed], "bitwise-equal losses"
    for name, overrides in runs.items():
        # dp 2, 4, 1: the same global samples from the memory-mapped store after any reshard
        resumed_batches = results["batches " + " ".join(overrides)]
        assert resumed_batches == {str(s): straight_batches[str(s)] for s in resumed}, name
        got = losses(results[" ".join(overrides)])
        for step in resumed:
            rel = abs(got[step] - reference[step]) / reference[step]
            assert rel < 1e-5, f"{name} step {step}: {got[step]} vs {reference[step]}"


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
