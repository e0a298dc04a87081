"""The planner against real runs: one 4-process gloo launch of tests/planner_driver.py.

- Parameter, gradient and optimizer bytes per rank of a real 2x2 (dp_shard 2 x tp 2) and HSDP
  2x2x1 (dp_replicate 2 x dp_shard 2) run, summed over the live shards after a training step,
  equal the dry run's numbers exactly (the dry run plans rank 0, which holds the most).
- What a tensor-parallel block keeps for backward (tp 2, sequence parallel on and off, each
  checkpointing kind, eager) equals models/llama3/memory.py's count exactly.
- Every process group starts with comm.init_timeout_seconds, switches to
  comm.train_timeout_seconds after the first step, and a collective that never completes
  fails after the timeout instead of hanging.
"""

import json
import subprocess
import sys

import pytest

from tests.dist_utils import ROOT, free_port, multi_rank_env
from trainer.config import load_config
from trainer.dry_run import plan

BASE = [
    "--job.config_file", "train_configs/debug_model.toml",
    "--model.flavor", "tinymodel",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.steps", "1",
    "--training.device", "cpu",
    "--lr_scheduler.warmup_steps", "0",
    "--activation_checkpoint.mode", "none",
    "--metrics.log_freq", "1",
    "--metrics.no-enable_tensorboard",
    "--comm.init_timeout_seconds", "120",
    "--comm.train_timeout_seconds", "60",
]
CONFIGS = {
    "dp_shard 2 x tp 2": ["--parallelism.tensor_parallel_degree", "2"],
    "dp_replicate 2 x dp_shard 2": ["--parallelism.data_parallel_replicate_degree", "2"],
}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    out = tmp_path_factory.mktemp("planner") / "result.json"
    args = [str(out), *BASE]
    for config in CONFIGS.values():
        args += ["--", *config]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{free_port()}", "tests/planner_driver.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=multi_rank_env())
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_state_bytes_equal_the_real_shards(real, name):
    ranks = real["states"][" ".join(CONFIGS[name])]
    estimate = plan(load_config([*BASE, *CONFIGS[name], "--comm.mode", "fake_backend"]), 4).memory.state
    assert (estimate.params, estimate.grads, estimate.optimizer) == (
        ranks[0]["params"], ranks[0]["grads"], ranks[0]["optimizer"])
    for rank in ranks:  # rank 0 holds the largest shards
        assert rank["params"] <= estimate.params and rank["optimizer"] <= estimate.optimizer


@pytest.mark.parametrize("sequence_parallel", [True, False])
@pytest.mark.parametrize("kind", ["none", "full", "op", "op_all"])
def test_tensor_parallel_block_activations_equal_the_count(real, kind, sequence_parallel):
    measured, counted = real["activations"][f"{kind} sp={sequence_parallel}"]
    assert measured == counted


def test_timeouts_switch_after_the_first_step_and_fire(real):
    for ranks in real["states"].values():
        for rank in ranks:
            assert set(rank["init_timeouts"]) == {120.0}
            assert set(rank["train_timeouts"]) == {60.0}
    timeout = real["timeout"]
    assert timeout["raised"] and "Timed out" in timeout["error"], timeout
    assert 1.9 <= timeout["seconds"] < 30, timeout  # the 2 s timeout, not the 60 s one
