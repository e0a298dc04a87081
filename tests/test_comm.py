"""[comm]: the flight recorder's environment, the traces folder rule, and the keys' checks.

The timeouts themselves (init, then train after the first step, and a collective that fails
instead of hanging) are checked on a real gloo job in tests/test_planner_gloo.py.
"""

import os

import pytest

from trainer.comm import configure_flight_recorder
from trainer.config import ConfigError, load_config
from trainer.run import resolve_run

NAMES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
TINY = ["--model.flavor", "tinymodel", "--training.seq_len", "32"]


@pytest.fixture
def clean_env(monkeypatch):
    """The recorder's variables unset during the test and again after it: configure_flight_recorder
    writes os.environ itself, and a leftover would reach every later test's subprocesses."""
    for name in NAMES:
        monkeypatch.setenv(name, "")  # makes monkeypatch restore the original state at teardown
        monkeypatch.delenv(name)


def test_flight_recorder_dumps_under_the_folder(tmp_path, clean_env):
    folder = tmp_path / "dump" / "comm_traces"
    configure_flight_recorder(2000, str(folder), "rank_")
    assert folder.is_dir()
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ  # deprecated: torch 2.13 warns on every rank
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(folder / "rank_")
    assert "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in os.environ  # deprecated: torch 2.11 warns on every rank


def test_flight_recorder_off(tmp_path, clean_env):
    configure_flight_recorder(0, str(tmp_path / "traces"), "rank_")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ and "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    assert not (tmp_path / "traces").exists()


def test_traces_folder_follows_the_dump_folder_rule(tmp_path):
    run = resolve_run(load_config(TINY + ["--job.dump_folder", str(tmp_path)]), 1)
    assert run.paths.comm_traces == os.path.join(str(tmp_path), "comm_traces")
    absolute = resolve_run(load_config(TINY + ["--comm.save_traces_folder", "/scratch/traces"]), 1)
    assert absolute.paths.comm_traces == "/scratch/traces"
    with pytest.raises(ConfigError, match="comm.save_traces_folder '../x' leaves job.dump_folder"):
        resolve_run(load_config(TINY + ["--comm.save_traces_folder", "../x"]), 1)


@pytest.mark.parametrize("overrides, needle", [
    (["--comm.train_timeout_seconds", "0"], "comm.train_timeout_seconds' must be >= 1"),
    (["--comm.trace_buf_size", "-1"], "comm.trace_buf_size' must be >= 0"),
    (["--comm.save_traces_file_prefix", "a/b"], "plain file-name prefix"),
    (["--comm.dry_run_mfu", "40"], "comm.dry_run_mfu is a fraction"),
    (["--comm.mode", "fake"], "must be one of default, fake_backend, local_tensor"),
])
def test_bad_comm_keys_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(TINY + overrides)


def test_a_dry_run_plans_for_gpus_on_a_cpu():
    run = resolve_run(load_config(TINY + ["--comm.mode", "fake_backend"]), 8)
    assert str(run.param_dtype) == "torch.bfloat16" and run.device.type == "cpu" and run.dry_run
    cpu_plan = resolve_run(load_config(TINY + ["--comm.mode", "fake_backend", "--training.device", "cpu"]), 8)
    assert str(cpu_plan.param_dtype) == "torch.float32"
