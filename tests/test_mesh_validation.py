"""Every invalid mesh configuration gives one clear message before any process group exists."""

import os
import subprocess
import sys

import pytest

from parallel.mesh import ParallelConfigError, ParallelDims
from trainer.config import ConfigError, load_config
from trainer.run import resolve_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model.flavor", "tinymodel", "--training.seq_len", "32"]


@pytest.mark.parametrize("world, overrides, needle", [
    (4, ["--parallelism.tensor_parallel_degree", "3"],
     "tensor_parallel_degree=3 x data_parallel_replicate_degree=1 does not divide the world size 4"),
    (4, ["--parallelism.data_parallel_replicate_degree", "3"], "data_parallel_replicate_degree=3 does not divide"),
    (8, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "3"],
     "(2) x data_parallel_shard_degree (3) x tensor_parallel_degree (1) = 6 but the world size is 8"),
    (4, ["--parallelism.data_parallel_replicate_degree", "0"], "data_parallel_replicate_degree must be >= 1"),
    (4, ["--parallelism.data_parallel_shard_degree", "3"], "set data_parallel_shard_degree to 4 or -1"),
    (8, ["--parallelism.tensor_parallel_degree", "8"], "n_kv_heads=4 is not divisible"),
    (4, ["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "30"], "training.seq_len=30"),
    (2, ["--training.global_batch_size", "6", "--training.local_batch_size", "2"], "training.global_batch_size = 6"),
    (2, ["--parallelism.tensor_parallel_degree", "2", "--training.head_loss", "fused"],
     "training.head_loss = 'fused' needs tensor_parallel_degree 1"),
])
def test_invalid_mesh(world, overrides, needle):
    cfg = load_config(TINY + overrides)
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, world)
    assert needle in str(e.value)


def test_ffn_hidden_and_vocab_divisibility():
    dims = ParallelDims.resolve(8, 1, -1, 8)
    with pytest.raises(ParallelConfigError, match="model FFN hidden size=100 is not divisible"):
        dims.check_divisible({"model FFN hidden size": 100})


def test_seq_len_not_divisible_is_fine_without_sequence_parallel():
    cfg = load_config(TINY + ["--parallelism.tensor_parallel_degree", "4", "--training.seq_len", "30",
                              "--parallelism.no-enable_sequence_parallel"])
    dims = resolve_run(cfg, 4).dims
    assert (dims.dp, dims.tp) == (1, 4)


def test_hsdp_mesh_resolves():
    cfg = load_config(TINY + ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.tensor_parallel_degree", "2"])
    dims = resolve_run(cfg, 8).dims
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp) == (2, 2, 2, 4)


def test_valid_2d_mesh_resolves():
    cfg = load_config(TINY + ["--parallelism.tensor_parallel_degree", "2"])
    run = resolve_run(cfg, 4)
    assert (run.dims.dp, run.dims.tp) == (2, 2)
    assert run.model_args.vocab_size % 512 == 0


def test_train_py_reports_mesh_error_once_with_exit_2():
    env = {**os.environ, "WORLD_SIZE": "4", "RANK": "0"}
    proc = subprocess.run([sys.executable, "train.py", *TINY, "--parallelism.tensor_parallel_degree", "3"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "parallelism.tensor_parallel_degree=3" in lines[0], proc.stderr
    quiet = subprocess.run([sys.executable, "train.py", *TINY, "--parallelism.tensor_parallel_degree", "3"],
                           cwd=ROOT, capture_output=True, text=True, env={**env, "RANK": "1"}, timeout=120)
    assert quiet.returncode == 2 and quiet.stderr.strip() == ""  # only rank 0 speaks


def test_run_train_sh_checks_config_before_launching():
    env = {**os.environ, "NGPU": "4", "PYTHON": sys.executable}
    proc = subprocess.run(["./run_train.sh", "--parallelism.tensor_parallel_degree", "3"], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "tensor_parallel_degree=3" in lines[0]
