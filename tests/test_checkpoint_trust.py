"""Trust in checkpoints: nothing in one runs code, damage is caught, bad state is never saved,
a full disk is one line, and resume takes the optimizer settings from the new config.

Single process on the toy model of test_checkpoint.py, except the lr test, which resumes the
real trainer, and the reproducer of a poisoned update, which runs train.py.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import runpy
import shutil
import subprocess
import sys
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from tests.dist_utils import ROOT
from tests.test_checkpoint import build, fake_step, world1  # noqa: F401 (fixture)
from tests.test_parallel_parity import BASE, launch
from trainer import checkpoint_manifest as manifest
from trainer.checkpoint import complete_steps
from trainer.errors import CheckpointError, CheckpointWriteError, NonFiniteError
from trainer.config import LRScheduler
from trainer.optim import lr_factor

CONVERT = runpy.run_path(os.path.join(ROOT, "scripts", "convert_to_hf.py"))["main"]


class _Touch:
    """Pickles as a call to builtins.open(marker, "w"): unpickling it creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def _short_str(text: str) -> bytes:
    """A pickle opcode pushing `text`, without touching the memo (so the real pickle after it stays valid)."""
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _reseal(folder: str) -> None:
    """Rewrite the manifest after tampering, as an attacker could: the manifest is no defence."""
    manifest.write(folder, manifest.checksum(folder, list(manifest.list_files(folder))))


def _plain_dcp_load(folder: str) -> None:
    """What torch's own DCP load does with the folder (the default reader and planner)."""
    model, opt, _, _, _ = build(os.path.dirname(os.path.dirname(folder)), seed=4)
    dcp.load({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=folder, no_dist=True)


def _convert(folder: str, out: str, capsys) -> tuple[int, str]:
    code = CONVERT([folder, out])
    return code, capsys.readouterr().err


def test_crafted_metadata_runs_nothing(tmp_path, capsys):
    _, _, _, _, mgr = build(str(tmp_path))
    mgr.save(1)
    folder = os.path.join(mgr.folder, "step-1")
    marker = tmp_path / "marker"
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        real = f.read()
    assert real[:2] == b"\x80\x04"
    # builtins.open(marker, "w") and drop its result, then the genuine metadata: a plain
    # unpickler runs the call and still returns valid metadata, so DCP loads normally.
    payload = b"cbuiltins\nopen\n" + _short_str(str(marker)) + _short_str("w") + pickle.TUPLE2 + pickle.REDUCE + pickle.POP
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(real[:2] + payload + real[2:])
    _reseal(folder)

    _plain_dcp_load(folder)
    assert marker.exists(), "the payload must run through torch's own loader, or this test proves nothing"
    marker.unlink()

    _, _, _, _, resume = build(str(tmp_path), seed=3)
    with pytest.raises(CheckpointError, match=r"\.metadata is refused or corrupt \(UnpicklingError: refusing to unpickle builtins\.open\)"):
        resume.load()
    code, err = _convert(folder, str(tmp_path / "hf"), capsys)
    assert code == 2 and err.count("\n") == 1 and "refusing to unpickle builtins.open" in err and ".metadata" in err
    assert not marker.exists()


def test_crafted_non_tensor_item_runs_nothing(tmp_path, capsys):
    model, opt, _, _, mgr = build(str(tmp_path))
    mgr.save(1)
    folder = os.path.join(mgr.folder, "step-1")
    marker = tmp_path / "marker"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    state["optim"]["param_groups"][0]["lr"] = _Touch(str(marker))
    for f in os.listdir(folder):
        if f.endswith(".distcp") or f == ".metadata":
            os.remove(os.path.join(folder, f))
    dcp.save(state, checkpoint_id=folder, no_dist=True)
    assert not marker.exists()
    _reseal(folder)

    _plain_dcp_load(folder)
    assert marker.exists(), "the payload must run through torch's own loader, or this test proves nothing"
    marker.unlink()

    _, _, _, _, resume = build(str(tmp_path), seed=3)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp: item optim\.param_groups\.0\.lr is refused "
                                              r"\(not plain data: Unsupported global: GLOBAL (builtins|io)\.open"):
        resume.load()
    assert not marker.exists()
    # convert_to_hf reads only the model's tensors, and those with weights_only=True.
    code, _ = _convert(folder, str(tmp_path / "hf"), capsys)
    assert code == 0 and not marker.exists()


def _flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_byte_flip_falls_back_to_previous_checkpoint(tmp_path, caplog):
    model, opt, sched, loader, mgr = build(str(tmp_path), steps=1)
    mgr.save(1)
    fake_step(model, opt, sched, loader)
    mgr.save(2)
    shard = os.path.join(mgr.folder, "step-2", "__0_0.distcp")
    with open(shard, "rb") as f:
        weights = f.read().index(model.tok_embeddings.weight.detach().numpy().tobytes()[:64])
    _flip_byte(shard, weights + 1000)  # inside the embedding's raw data: a silent change of one weight

    _, _, _, _, unchecked = build(str(tmp_path), seed=5, verify=False)
    assert unchecked.load() == 2, "without the manifest the damage goes unnoticed"

    model2, _, _, loader2, checked = build(str(tmp_path), seed=5)
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert checked.load() == 1
    assert loader2.samples == 8
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert f"checkpoint {mgr.folder}/step-2 is damaged, skipping it: {shard}: bytes" in warned
    assert "differ from the manifest (crc32)" in warned

    _, _, _, _, exact = build(str(tmp_path), seed=5, load_step=2)
    with pytest.raises(CheckpointError, match=r"no checkpoint .* matches its manifest .*--checkpoint.no-verify"):
        exact.load()

    os.remove(os.path.join(mgr.folder, "step-1", manifest.MANIFEST))  # as written by an older weft
    shutil.rmtree(os.path.join(mgr.folder, "step-2"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert build(str(tmp_path), seed=5)[4].load() == 1
    assert "has no manifest.json (saved by an older weft): loading it unverified" in caplog.text


def test_manifest_split_reads_each_file_once():
    sizes = {"__0_0.distcp": 100, "__1_0.distcp": 90, "__2_0.distcp": 95, "__3_0.distcp": 99, ".metadata": 7,
             "trainer_state.pt": 5, "rng-rank0.pt": 1, "rng-rank3.pt": 1, "config.toml": 2, "fingerprint.json": 3}
    for world in (1, 2, 4, 8):
        shares = manifest.assign(sizes, world)
        assert sorted(n for s in shares for n in s) == sorted(sizes)
    shares = manifest.assign(sizes, 4)
    assert "__3_0.distcp" in shares[3] and "rng-rank3.pt" in shares[3]  # read where it was written
    shares = manifest.assign(sizes, 2)
    loads = [sum(sizes[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= 100  # written by 4 ranks, balanced over 2


def test_corrupt_small_files_and_metadata_are_one_line(tmp_path, caplog):
    _, _, _, _, mgr = build(str(tmp_path))
    mgr.save(1)
    folder = os.path.join(mgr.folder, "step-1")
    with open(os.path.join(folder, "rng-rank0.pt"), "wb") as f:
        f.write(os.urandom(300))
    with pytest.raises(CheckpointError, match=r"rng-rank0.pt is missing or corrupt \(") as info:
        build(str(tmp_path), seed=1, verify=False)[4].load()
    assert "weights_only" not in str(info.value) and "\n" not in str(info.value)

    meta = os.path.join(folder, ".metadata")
    for damage, expected in ((lambda: os.remove(meta), r"\.metadata is missing"),
                             (lambda: open(meta, "wb").write(os.urandom(64)), r"\.metadata is refused or corrupt")):
        damage()
        caplog.clear()
        with caplog.at_level(logging.DEBUG), pytest.raises(CheckpointError, match=expected) as info:
            build(str(tmp_path), seed=1, verify=False)[4].load()
        assert "\n" not in str(info.value)
        assert not [r for r in caplog.records if r.exc_info], "no traceback is logged before the clean line"


def test_non_finite_weights_are_not_saved(tmp_path):
    model, _, _, _, mgr = build(str(tmp_path))
    mgr.save(1)
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[3, 4] = float("nan")
    with pytest.raises(NonFiniteError, match=r"NaN/Inf at step 2 \(1 tensors, e.g. layers.1.feed_forward.w2.weight\)"
                                                  r".*newest checkpoint is step-1"):
        mgr.save(2)
    assert sorted(os.listdir(mgr.folder)) == ["step-1"]
    with torch.no_grad():
        model.layers["1"].feed_forward.w2.weight[3, 4] = 3e38  # huge but finite: saved
        model.norm.weight[0] = -float("inf")
    with pytest.raises(NonFiniteError, match=r"\(1 tensors, e.g. norm.weight\)"):
        mgr.save(2)
    with torch.no_grad():
        model.norm.weight[0] = 1.0
    mgr.save(2)
    assert complete_steps(mgr.folder) == [1, 2]


@pytest.fixture
def tiny_disk(tmp_path):
    """A tmpfs of `size` bytes (root only), unmounted afterwards."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    mounted = []

    def mount(size: int) -> str:
        path = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
        path.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounted.append(path)
        return str(path)

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_full_disk_keeps_previous_checkpoint(tmp_path, world1, tiny_disk, async_mode):
    model, opt, sched, loader, probe = build(str(tmp_path / "probe"))
    probe.save(1)
    one = sum(os.path.getsize(os.path.join(probe.folder, "step-1", f)) for f in os.listdir(os.path.join(probe.folder, "step-1")))
    disk = tiny_disk(int(one * 1.5) // 4096 * 4096)  # room for one checkpoint, not two

    model, opt, sched, loader, mgr = build(disk, async_mode=async_mode)
    mgr.save(1)
    fake_step(model, opt, sched, loader)
    with pytest.raises(CheckpointWriteError) as info:
        mgr.save(2)
        mgr.wait()
    message = str(info.value)
    assert "\n" not in message
    assert f"no space left on the disk of {mgr.folder} (mounted at {disk})" in message
    assert "KiB free after removing the partial save; the previous checkpoint step-1 is intact" in message
    assert sorted(os.listdir(mgr.folder)) == ["step-1"], "the partial save is removed"
    assert build(disk, seed=3)[4].load() == 1


def test_poisoned_update_stops_without_saving(tmp_path, corpus):
    """The reproducer of the issue: the first update makes the weights non-finite."""
    dump = tmp_path / "poison"
    proc = subprocess.run(
        [sys.executable, "train.py", *BASE, "--training.dataset_path", corpus, "--job.dump_folder", str(dump),
         "--optimizer.lr", "3e37", "--optimizer.weight_decay", "11", "--lr_scheduler.warmup_steps", "0",
         "--checkpoint.enable", "--checkpoint.interval", "1", "--training.steps", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("weft:")]
    assert len(errors) == 1 and "NaN/Inf at step 1" in errors[0] and "Traceback" not in proc.stderr
    assert not (dump / "checkpoint").exists() or not os.listdir(dump / "checkpoint"), "nothing saved, not even a .tmp"


def test_resume_takes_optimizer_settings_from_the_new_config(tmp_path, corpus, caplog):
    # In process on the toy model: every key changed is put back and logged once.
    model, opt, sched, loader, mgr = build(str(tmp_path / "toy"), steps=2)
    mgr.save(2)
    model2 = build(str(tmp_path / "other"), steps=0)[0]
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.3, foreach=False)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    from tests.test_checkpoint import manager

    resumed = manager(str(tmp_path / "toy"), model2, opt2, sched2, None)
    with caplog.at_level(logging.INFO, logger="trainer.checkpoint"):
        assert resumed.load() == 2
    changes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("optimizer.")]
    assert [c.split(" (")[0] for c in changes] == [
        "optimizer.lr: 0.01 -> 0.5", "optimizer.beta1: 0.9 -> 0.8", "optimizer.beta2: 0.999 -> 0.99",
        "optimizer.eps: 1e-08 -> 1e-06", "optimizer.weight_decay: 0.01 -> 0.3"]
    group = opt2.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["initial_lr"]) == ((0.8, 0.99), 1e-6, 0.3, 0.5)
    assert group["lr"] == sched2.get_last_lr()[0] == 0.5 / 3
    assert len(opt2.state) == len(opt.state) and sched2.last_epoch == 2  # the rest is the checkpoint's

    # Through the trainer: the logged lr of every resumed step is a fresh schedule with the new peak.
    folder = str(tmp_path / "ckpt")
    common = BASE + ["--training.dataset_path", corpus, "--checkpoint.enable", "--checkpoint.folder", folder,
                     "--lr_scheduler.warmup_steps", "2"]
    first = ["--training.steps", "2"]
    second = ["--training.steps", "5", "--optimizer.lr", "0.05", "--lr_scheduler.decay_type", "cosine",
              "--lr_scheduler.min_lr_factor", "0.1"]
    results = launch(tmp_path, 1, common, [first, second])
    new_schedule = LRScheduler(warmup_steps=2, decay_type="cosine", min_lr_factor=0.1)
    logged = {r["step"]: r["lr"] for r in results[" ".join(second)]}
    assert sorted(logged) == [3, 4, 5]
    for step, lr in logged.items():
        assert math.isclose(lr, lr_factor(step, total_steps=5, cfg=new_schedule) * 0.05, rel_tol=1e-12), step
