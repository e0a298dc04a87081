"""Guards around a run: one line and exit 2 for every mistake, the dump-folder lock, records
that show each step once after a resume, what the console shows of saves and the resume, and a
global batch that follows the checkpoint.

The one-line checks run `trainer.main.main` in process with WEFT_CHECK_CONFIG_ONLY=1, which
stops after everything that needs no process group (config, model, mesh, folders, local data
paths, the lock) has been checked: the same path `run_train.sh` takes before launching.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.dist_utils import ROOT, free_port
from trainer.config import load_config
from trainer.dump_lock import LOCK_NAME, DumpFolderLock
from trainer.errors import DumpFolderInUse
from trainer.main import main, setup_logging
from trainer.run import resolve_run

TINY = ["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "tinymodel",
        "--training.seq_len", "32"]


def _check_only(monkeypatch, capsys, tmp_path, *overrides):
    monkeypatch.setenv("WEFT_CHECK_CONFIG_ONLY", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code = main([*TINY, "--job.dump_folder", str(tmp_path / "dump"), *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("overrides, needle", [
    (["--compile.enable", "--compile.backend", "nonexistent"], "compile.backend 'nonexistent' is not a torch.compile backend"),
    (["--optimizer.lr", "nan"], "'optimizer.lr' must be a finite number"),
    (["--optimizer.lr", "inf"], "'optimizer.lr' must be a finite number"),
    (["--optimizer.lr", "1e300"], "'optimizer.lr' must be a finite number"),
    (["--optimizer.eps", "nan"], "'optimizer.eps' must be a finite number"),
    (["--optimizer.weight_decay", "nan"], "'optimizer.weight_decay' must be a finite number"),
    (["--training.max_norm", "-1"], "training.max_norm must be >= 0"),
    (["--training.max_norm", "nan"], "training.max_norm must be >= 0"),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "3"],
     "selective_ac_option = 3 is larger than the model's 2 layers"),
    (["--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", "op:3"],
     "per_block = 'op:3' lays out 3 blocks; the model has 2"),
    (["--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", "op,full"],
     "activation_checkpoint.per_block must be kind:count,..."),
    (["--activation_checkpoint.mode", "per_block"], "mode = 'per_block' needs activation_checkpoint.per_block"),
    (["--activation_checkpoint.mode", "per_block", "--activation_checkpoint.per_block", "op:1,full:1",
      "--compile.enable", "true", "--compile.strategy", "blocks", "--compile.recompile_limit", "1"],
     "compiles 2 block graphs, more than compile.recompile_limit = 1"),
    (["--checkpoint.folder", "../elsewhere"], "checkpoint.folder '../elsewhere' leaves job.dump_folder"),
    (["--metrics.save_tb_folder", "a/../../tb"], "metrics.save_tb_folder 'a/../../tb' leaves job.dump_folder"),
    (["--profiling.save_traces_folder", ".."], "profiling.save_traces_folder '..' leaves job.dump_folder"),
    (["--profiling.save_memory_snapshot_folder", "../m"], "save_memory_snapshot_folder '../m' leaves"),
    (["--training.dataset_path", "/nonexistent/weft/*.jsonl"], "training.dataset_path '/nonexistent/weft/*.jsonl' matches no"),
    (["--training.dataset_mixture", "stdlib:0.5,/nonexistent/code:0.5"], "training.dataset_mixture '/nonexistent/code' matches no"),
    (["--training.dataset_mixture", "stdlib"], "training.dataset_mixture item 'stdlib' must be 'SOURCE:WEIGHT'"),
    (["--validation.enable", "true", "--validation.dataset_path", "/nonexistent/val"], "validation.dataset_path '/nonexistent/val' matches no"),
])
def test_mistake_is_one_line_with_exit_2(monkeypatch, capsys, tmp_path, overrides, needle):
    code, out, err = _check_only(monkeypatch, capsys, tmp_path, *overrides)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err
    assert not os.path.exists(tmp_path / "dump" / "config.toml")


def test_streaming_token_files_is_one_line_before_launch(monkeypatch, capsys, tmp_path):
    np.save(tmp_path / "tokens.npy", np.arange(100, dtype=np.uint32))
    code, _, err = _check_only(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(tmp_path / "tokens.npy"),
                               "--training.dataset_streaming", "true")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "holds token files, which are memory-mapped, not streamed" in lines[0], err
    code, _, err = _check_only(monkeypatch, capsys, tmp_path, "--training.dataset_path", str(tmp_path / "tokens.npy"))
    assert code == 0, err


def test_unwritable_dump_folder(monkeypatch, capsys, tmp_path):
    if os.geteuid() == 0:
        blocked = tmp_path / "file"  # root ignores permissions: a file in the way fails for anyone
        blocked.write_text("")
        target = blocked / "dump"
    else:
        blocked = tmp_path / "ro"
        blocked.mkdir(mode=0o500)
        target = blocked / "dump"
    monkeypatch.setenv("WEFT_CHECK_CONFIG_ONLY", "1")
    monkeypatch.delenv("RANK", raising=False)
    code = main([*TINY, "--job.dump_folder", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f"job.dump_folder '{target}' cannot be created" in err[0]


def test_absolute_folders_are_allowed_and_warmup_past_steps_warns(monkeypatch, capsys, tmp_path):
    code, out, err = _check_only(monkeypatch, capsys, tmp_path, "--checkpoint.folder", str(tmp_path / "ckpt"),
                                 "--lr_scheduler.warmup_steps", "100", "--training.steps", "10")
    assert code == 0, err
    warnings = [line for line in out.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "lr_scheduler.warmup_steps (100) > training.steps (10)" in warnings[0]
    run = resolve_run(load_config([*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.folder", "/x/ckpt"]), 1)
    assert run.paths.checkpoint == "/x/ckpt" and run.paths.tensorboard == os.path.join(str(tmp_path), "tb")


def test_lock_takes_over_a_dead_owner_and_refuses_a_live_or_remote_one(tmp_path, capsys):
    setup_logging(rank=0)
    path = tmp_path / LOCK_NAME
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": "earlier"}))
    with DumpFolderLock(str(tmp_path)):
        assert json.loads(path.read_text())["pid"] == os.getpid()
        with pytest.raises(DumpFolderInUse, match=f"in use by pid {os.getpid()} on this host"):
            DumpFolderLock(str(tmp_path)).acquire()
    assert "no longer running" in capsys.readouterr().out
    assert not path.exists()  # released
    path.write_text(json.dumps({"host": "another-host", "pid": 1, "started": "earlier"}))
    with pytest.raises(DumpFolderInUse, match=f"on host another-host .* rm {path}"):
        DumpFolderLock(str(tmp_path)).acquire()
    assert path.exists()  # never removed: it may be live


def test_global_batch_minus_one_follows_the_checkpoint(tmp_path):
    step = tmp_path / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    torch.save({"step": 4, "dataloader": {"global_batch_size": 16}}, step / "trainer_state.pt")
    args = [*TINY, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--training.local_batch_size", "2"]
    run = resolve_run(load_config(args), 4)
    assert (run.resume_step, run.global_batch_size, run.grad_accum_steps) == (4, 16, 2)
    fresh = resolve_run(load_config(args + ["--checkpoint.no-enable"]), 4)
    assert (fresh.resume_step, fresh.global_batch_size, fresh.grad_accum_steps) == (None, 8, 1)


def _train(dump, *overrides, check=True, nproc=1, **popen):
    launcher = ["train.py"] if nproc == 1 else [
        "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}", "train.py"]
    cmd = [sys.executable, *launcher, *TINY, "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
           "--checkpoint.enable", "--checkpoint.interval", "3", "--lr_scheduler.warmup_steps", "2", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_second_run_is_refused_and_the_first_finishes_clean(tmp_path, corpus):
    dump = tmp_path / "run"
    first = _train(dump, "--training.dataset_path", corpus, "--training.steps", "20",
                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = dump / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.5)
    second = _train(dump, "--training.dataset_path", corpus, "--training.steps", "6", check=False)
    assert second.returncode == 2
    err = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and f"in use by pid {first.pid} on this host" in err[0], second.stderr
    out, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out[-3000:]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 21))
    assert not (dump / LOCK_NAME).exists()


@pytest.fixture(scope="module")
def resumed_two_rank_run(tmp_path_factory, corpus):
    """A 2-rank `train.py` run of 6 steps whose last save did not land (killed after step 6's
    records, before its checkpoint), then the run resumed to step 8 from step 3: (dump folder,
    first and second launch, the first launch's compile events). Shared by the tests below, as
    each launch costs ~25 s on 2 cores. The compile events are the graph breaks at FSDP2's hooks
    under whole-model compile (the fully_shard engine), recorded by rank 0."""
    dump = tmp_path_factory.mktemp("resumed") / "run"
    compiled = ["--compile.enable", "--compile.backend", "eager", "--compile.strategy", "model",
                "--parallelism.data_parallel_engine", "fully_shard"]
    first = _train(dump, "--training.dataset_path", corpus, "--training.steps", "6", *compiled, nproc=2)
    os.rename(dump / "checkpoint" / "step-6", dump / "checkpoint" / "step-6.tmp")  # as if killed mid-save
    first_events = [json.loads(line) for line in (dump / "compile_events.jsonl").read_text().splitlines()]
    with open(dump / "compile_events.jsonl", "a") as f:  # as if the killed process recompiled at step 5
        f.write(json.dumps({**first_events[0], "kind": "recompile", "step": 5, "summary": "from the lost steps"}) + "\n")
    second = _train(dump, "--training.dataset_path", corpus, "--training.steps", "8", *compiled, nproc=2)
    return dump, first, second, first_events


def test_resumed_run_records_each_step_once(resumed_two_rank_run):
    """The resumed run writes steps 4.. again: metrics.jsonl, TensorBoard and the compile events
    must hold each step once."""
    dump, _, _, first_events = resumed_two_rank_run
    assert first_events and all(e["step"] == 1 for e in first_events), first_events
    steps = [json.loads(line)["step"] for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))
    (event_dir,) = {os.path.dirname(p) for p in map(str, (dump / "tb").rglob("events.*"))}
    acc = EventAccumulator(event_dir)
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/loss")] == list(range(1, 9))
    events = [json.loads(line) for line in (dump / "compile_events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [1] * len(first_events) + [4] * len(first_events)
    report = (dump / "compile_report.txt").read_text()
    assert "resumed the run at step 3" in report and "from the lost steps" not in report


def test_saves_and_resume_are_logged_once_by_rank_0(resumed_two_rank_run):
    """What a user sees in the console of a 2-rank run: checkpoint saves and the resume, once each,
    from rank 0, with timestamps; the other rank stays quiet below WARNING."""
    _, first, second, _ = resumed_two_rank_run
    saved = [line for line in first.stdout.splitlines() if "checkpoint step 3 saved" in line]
    assert len(saved) == 1 and re.match(r"\[weft\] \d\d:\d\d:\d\d checkpoint step 3 saved to ", saved[0]), first.stdout
    console = second.stdout + second.stderr
    resumed = [line for line in console.splitlines() if "resumed from checkpoint step 3" in line]
    assert len(resumed) == 1 and resumed[0].startswith("[weft] "), console
    assert len([line for line in console.splitlines() if "checkpoint step 8 saved" in line]) == 1
    assert "[weft rank1]" not in first.stdout + first.stderr + console  # rank 1 logs warnings only, and there were none


def test_sigkill_leaves_a_stale_lock_that_the_next_run_takes_over(tmp_path, corpus):
    dump = tmp_path / "run"
    proc = _train(dump, "--training.dataset_path", corpus, "--training.steps", "1000",
                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and not (dump / LOCK_NAME).exists():
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (dump / LOCK_NAME).exists()
    env = {**os.environ, "WEFT_CHECK_CONFIG_ONLY": "1"}
    again = subprocess.run([sys.executable, "train.py", *TINY, "--job.dump_folder", str(dump)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "taking over the lock" in again.stdout, again.stderr
