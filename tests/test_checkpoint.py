"""Checkpoint manager and preemption flag, on CPU with gloo.

The models here are toys with our parameter names so the tests do not depend on
models/. The multi-process test reshards one checkpoint across three meshes inside
a single 4-process spawn to keep the runtime small.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.dist_utils import exit_without_finalizing  # noqa: E402
from trainer.checkpoint import HOLD_ENV, CheckpointError, CheckpointManager, complete_steps  # noqa: E402
from trainer.config import Checkpoint, ConfigError  # noqa: E402
from trainer.preemption import PreemptionHandler  # noqa: E402

ARGS = {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_seq_len": 128}


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        hd = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(n_heads * hd, dim, bias=False)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, 48)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)


class ToyLlama(nn.Module):
    """Parameter names and shapes of our Llama; no forward (tests set grads directly)."""

    def __init__(self, dim: int = 32, n_layers: int = 2, n_heads: int = 4, n_kv_heads: int = 2, vocab: int = 64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, n_heads, n_kv_heads) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)


class ToyMLP(nn.Module):
    """RMSNorm + SwiGLU FFN: enough for an FSDP2 x TP plan (colwise w1/w3, rowwise w2)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.ff = FeedForward(16, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(self.norm(x))


class Loader:
    """Stands in for the data loader: its state is global samples consumed."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        self.samples = state["samples"]


def make_optim(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def fake_step(model: nn.Module, opt: torch.optim.Optimizer, sched, loader: Loader) -> None:
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sched.step()
    loader.samples += 8


def manager(dump: str, model, opt, sched, loader, **cfg) -> CheckpointManager:
    ckpt = Checkpoint(**{"enable": True, "folder": "ckpt", "interval": 1, "keep_latest_k": 0, **cfg})
    return CheckpointManager(ckpt, dump_folder=dump, model=model, optimizer=opt, lr_scheduler=sched,
                             dataloader=loader, extra_state=lambda: {"tokens": 1234}, config_toml="[job]\n",
                             model_fingerprint=ARGS)


def build(dump: str, seed: int = 0, steps: int = 1, **cfg) -> tuple:
    """A ToyLlama trained `steps` fake steps from `seed`, with its optimizer, scheduler, loader, manager."""
    torch.manual_seed(seed)
    model = ToyLlama()
    opt, sched = make_optim(model)
    loader = Loader()
    for _ in range(steps):
        fake_step(model, opt, sched, loader)
    return model, opt, sched, loader, manager(dump, model, opt, sched, loader, **cfg)


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}}


def assert_same(a, b) -> None:
    """Exact equality of nested dicts/lists of tensors and plain values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def tree_digest(folder: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def world1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- single process


def test_round_trip_restores_everything(tmp_path, world1):
    model, opt, sched, loader, mgr = build(str(tmp_path), seed=0, steps=2)
    mgr.save(2)
    mgr.close()
    ref, rng = snapshot(model, opt), torch.get_rng_state()
    torch.randn(10)  # move the RNG so restoring it is observable

    model2, opt2, sched2, loader2, mgr2 = build(str(tmp_path), seed=1, steps=1)
    assert mgr2.load() == 2
    assert_same(ref, snapshot(model2, opt2))
    assert sched2.last_epoch == sched.last_epoch == 2
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert loader2.samples == loader.samples == 16
    assert mgr2.restored_extra_state == {"tokens": 1234}
    assert torch.equal(torch.get_rng_state(), rng)
    ckpt = tmp_path / "ckpt" / "step-2"
    assert (ckpt / "config.toml").read_text() == "[job]\n"
    assert json.loads((ckpt / "fingerprint.json").read_text())["params"]["layers.0.attention.wk.weight"] == [16, 32]

    _, _, _, _, mgr3 = build(str(tmp_path), load_step=7)
    with pytest.raises(CheckpointError, match="load_step = 7.*complete steps: 2"):
        mgr3.load()
    _, _, _, _, empty = build(str(tmp_path / "elsewhere"))
    assert empty.load() == 0


def test_async_equals_sync_and_is_isolated_from_later_steps(tmp_path, world1):
    model, opt, sched, loader, sync_mgr = build(str(tmp_path / "sync"), steps=2)
    sync_mgr.save(2)
    async_mgr = manager(str(tmp_path / "async"), model, opt, sched, loader, async_mode="async")
    ref = snapshot(model, opt)
    async_mgr.save(2)
    assert not (tmp_path / "async" / "ckpt" / "step-2").exists()  # published only once the write is done
    fake_step(model, opt, sched, loader)  # the next step mutates params and optimizer state in place
    async_mgr.wait()
    assert complete_steps(str(tmp_path / "async" / "ckpt")) == [2]

    loaded = []
    for sub in ("sync", "async"):
        m, o, _, _, mgr = build(str(tmp_path / sub), seed=5)
        assert mgr.load() == 2
        loaded.append(snapshot(m, o))
    assert_same(loaded[0], ref)
    assert_same(loaded[1], ref)


def test_model_only_final_checkpoint(tmp_path):
    model, opt, _, _, mgr = build(str(tmp_path), steps=1, interval=10, model_only_final=True, export_dtype="bfloat16")
    mgr.maybe_save(3)  # not an interval step
    assert complete_steps(mgr.folder) == []
    mgr.maybe_save(5, last=True)
    assert complete_steps(mgr.folder) == [5]
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(os.path.join(mgr.folder, "step-5")).read_metadata()
    assert all(k.startswith("model.") for k in md.state_dict_metadata)
    assert {m.properties.dtype for m in md.state_dict_metadata.values()} == {torch.bfloat16}

    m2, o2, _, _, mgr2 = build(str(tmp_path), seed=3, steps=0)
    assert mgr2.load() == 5
    for k, v in model.state_dict().items():
        assert torch.equal(m2.state_dict()[k], v.to(torch.bfloat16).float())
    assert len(o2.state) == 0


def test_fingerprint_mismatch_and_corruption_leave_folder_unchanged(tmp_path):
    _, _, _, _, mgr = build(str(tmp_path))
    mgr.save(1)
    folder = mgr.folder
    before = tree_digest(folder)

    torch.manual_seed(0)
    other = ToyLlama(dim=48, n_heads=4)
    opt, sched = make_optim(other)
    mgr2 = CheckpointManager(Checkpoint(enable=True, folder="ckpt"), dump_folder=str(tmp_path), model=other,
                             optimizer=opt, lr_scheduler=sched, dataloader=None)
    with pytest.raises(CheckpointError, match=r"different model: \d+ param shapes differ \(e.g. layers"):
        mgr2.load()
    assert tree_digest(folder) == before
    assert not isinstance(CheckpointError("x"), ConfigError)  # reported as a checkpoint error, exit code 2
    assert CheckpointError.exit_code == 2

    shard = next(f for f in os.listdir(os.path.join(folder, "step-1")) if f.endswith(".distcp"))
    path = os.path.join(folder, "step-1", shard)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    corrupt = tree_digest(folder)
    _, _, _, _, checked = build(str(tmp_path), seed=2)
    with pytest.raises(CheckpointError, match=f"no checkpoint .* matches its manifest .*{shard} has"):
        checked.load()
    _, _, _, _, mgr3 = build(str(tmp_path), seed=2, verify=False)  # what DCP itself says of the truncated file
    with pytest.raises(CheckpointError, match="step-1 is unreadable"):
        mgr3.load()
    assert tree_digest(folder) == corrupt

    with open(os.path.join(folder, "step-1", "trainer_state.pt"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match="trainer_state.pt is missing or corrupt"):
        mgr3.load()


_KILL_SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r})
from test_checkpoint import build, fake_step
model, opt, sched, loader, mgr = build({dump!r})
mgr.save(1)
torch.save(model.state_dict(), {ref!r})
os.environ[{hold!r}] = "120"
fake_step(model, opt, sched, loader)
mgr.save(2)
"""


def test_sigkill_mid_save_keeps_previous_and_keep_latest_k(tmp_path):
    ref = str(tmp_path / "ref1.pt")
    script = _KILL_SCRIPT.format(tests=os.path.dirname(__file__), dump=str(tmp_path), ref=ref, hold=HOLD_ENV)
    proc = subprocess.Popen([sys.executable, "-c", script])
    folder = tmp_path / "ckpt"
    deadline = time.monotonic() + 90
    try:
        while not (folder / "step-2.tmp" / ".metadata").exists():
            assert not (folder / "step-2").exists(), "step-2 was marked complete before the hold"
            assert proc.poll() is None, "saving process exited before reaching the hold"
            assert time.monotonic() < deadline, "saving process never reached the hold"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    assert complete_steps(str(folder)) == [1]

    model, _, _, _, mgr = build(str(tmp_path), seed=9, steps=0, keep_latest_k=2)
    assert mgr.load() == 1
    assert_same(torch.load(ref), model.state_dict())
    assert (folder / "step-2.tmp").is_dir()  # load changes nothing on disk

    mgr.save(3)
    assert sorted(os.listdir(folder)) == ["step-1", "step-3"]  # stale .tmp cleaned by a successful save
    mgr.save(4)
    mgr.save(5)
    assert sorted(os.listdir(folder)) == ["step-4", "step-5"]
    mgr.save(3)  # as after resuming from an older step: the checkpoint just written is kept
    assert sorted(os.listdir(folder)) == ["step-3", "step-4", "step-5"]
    mgr.save(5)  # same step again replaces it
    assert sorted(os.listdir(folder)) == ["step-4", "step-5"]


def test_preemption_flag_single_process():
    handler = PreemptionHandler(signals=(signal.SIGUSR1,), check_freq=3)
    try:
        assert not handler.should_stop(3)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert not handler.should_stop(4)  # only multiples of check_freq look at the flag
        assert handler.should_stop(6)
        assert handler.should_stop(7, force_check=True)
    finally:
        handler.close()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


# ---------------------------------------------------------------- 4 processes: reshard


def _parallelize(model: ToyMLP, dp: int, tp: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {"ff.w1": ColwiseParallel(), "ff.w3": ColwiseParallel(), "ff.w2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def _full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=options),
            "optim": get_optimizer_state_dict(model, opt, options=options)}


def _reshard_worker(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = ToyMLP()
    mesh = _parallelize(model, 2, 2)
    opt, sched = make_optim(model)
    loader = Loader()
    for _ in range(2):
        torch.manual_seed(100 + mesh["dp"].get_local_rank())  # data differs across dp, equal across tp
        model(torch.randn(4, 16)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        loader.samples += 8
    cfg = Checkpoint(enable=True, folder="ckpt", async_mode="async")
    mgr = CheckpointManager(cfg, dump_folder=tmp, model=model, optimizer=opt, lr_scheduler=sched,
                            dataloader=loader)
    mgr.save(2)
    mgr.close()
    ref = _full_state(model, opt)
    if rank == 0:
        torch.save(ref, os.path.join(tmp, "ref.pt"))

    for dp, tp in ((4, 1), (1, 4)):
        torch.manual_seed(1)
        model2 = ToyMLP()
        _parallelize(model2, dp, tp)
        opt2, sched2 = make_optim(model2)
        loader2 = Loader()
        mgr2 = CheckpointManager(cfg, dump_folder=tmp, model=model2, optimizer=opt2, lr_scheduler=sched2,
                                 dataloader=loader2)
        assert mgr2.load() == 2
        got = _full_state(model2, opt2)
        if rank == 0:
            assert_same(got, ref)
        assert loader2.samples == 16 and sched2.last_epoch == 2

    # A flipped byte in the file that rank 3 verifies stops every rank with the same error.
    shard = os.path.join(tmp, "ckpt", "step-2", "__3_0.distcp")
    if rank == 0:
        shutil.copy(shard, shard + ".bak")
        with open(shard, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    with pytest.raises(CheckpointError, match=r"no checkpoint .* matches its manifest .*__3_0\.distcp: bytes 0-"):
        mgr2.load()
    dist.barrier()
    if rank == 0:
        os.replace(shard + ".bak", shard)

    handler = PreemptionHandler(signals=(signal.SIGUSR1,), check_freq=2)
    assert not handler.should_stop(2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    assert not handler.should_stop(3)  # a step that does not check: no collective, no stop
    assert handler.should_stop(4)  # every rank agrees, not only rank 1
    handler.close()
    dist.destroy_process_group()
    exit_without_finalizing()


def _spawn(fn, nprocs: int, args: tuple, timeout: float) -> None:
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} did not finish in {timeout}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def test_reshard_2x2_to_4x1_1x4_and_one_process(tmp_path):
    _spawn(_reshard_worker, 4, (4, str(tmp_path)), timeout=150)
    ref = torch.load(tmp_path / "ref.pt")
    torch.manual_seed(2)
    model = ToyMLP()
    opt, sched = make_optim(model)
    mgr = CheckpointManager(Checkpoint(enable=True, folder="ckpt"), dump_folder=str(tmp_path), model=model,
                            optimizer=opt, lr_scheduler=sched, dataloader=None)
    assert mgr.load() == 2
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    assert_same({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}, ref)
