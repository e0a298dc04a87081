"""Config precedence, CLI forms, and every error path (one clear message, exit code 2)."""

import os
import subprocess
import sys

import pytest

from trainer.config import ConfigError, JobConfig, help_text, load_config, to_toml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_then_toml_then_cli(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 0.01
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default kept


def test_cli_forms():
    cfg = load_config([
        "--training.steps=3", "--compile.enable", "--parallelism.no-enable_sequence_parallel",
        "--parallelism.no_enable_loss_parallel", "--metrics.enable_tensorboard", "false",
        "--compile.components", "model,loss", "--lr_scheduler.decay_ratio", "0.5",
    ])
    assert cfg.training.steps == 3
    assert cfg.compile.enable is True
    assert cfg.parallelism.enable_sequence_parallel is False
    assert cfg.parallelism.enable_loss_parallel is False
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.compile.components == ["model", "loss"]
    assert cfg.lr_scheduler.decay_ratio == 0.5


@pytest.mark.parametrize("argv, needle", [
    (["--training.stepz", "3"], "Did you mean 'training.steps'"),
    (["--trainin.steps", "3"], "Did you mean 'training'"),
    (["--training.steps", "three"], "'training.steps' expects int"),
    (["--training.steps"], "missing value for --training.steps"),
    (["--compile.strategy", "modle"], "Did you mean 'model'"),
    (["--job.config_file", "/nonexistent.toml"], "not found"),
    (["--training.seq_len", "0"], "training.seq_len"),
    (["stray"], "unexpected argument"),
])
def test_cli_errors(argv, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(argv)
    assert needle in str(e.value)


def test_toml_errors(tmp_path):
    bad_syntax = write(tmp_path, "[training]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match="line 2"):
        load_config(["--job.config_file", bad_syntax])
    wrong_type = write(tmp_path, '[training]\nsteps = "ten"\n', "t.toml")
    with pytest.raises(ConfigError, match="'training.steps' expects int"):
        load_config(["--job.config_file", wrong_type])
    unknown = write(tmp_path, "[training]\nbatch = 3\n", "u.toml")
    with pytest.raises(ConfigError, match="unknown config key 'training.batch'"):
        load_config(["--job.config_file", unknown])


def test_to_toml_round_trip(tmp_path):
    cfg = load_config(["--training.steps", "11", "--compile.components", "loss", "--job.description", 'a "q"'])
    path = write(tmp_path, to_toml(cfg))
    loaded = load_config(["--job.config_file", path])
    assert loaded.job.config_file == path  # the only key that names where it was loaded from
    loaded.job.config_file = cfg.job.config_file
    assert loaded == cfg


def test_help_lists_every_key():
    text = help_text()
    for section, values in JobConfig().to_dict().items():
        for key in values:
            assert f"--{section}.{key}" in text


def run_train(*args, env=None):
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def test_train_py_config_error_is_one_line_exit_2():
    proc = run_train("--job.config_file", "train_configs/debug_model.toml", "--training.stepz", "3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "training.steps" in lines[0]


def test_train_py_help():
    proc = run_train("--help")
    assert proc.returncode == 0
    assert "--parallelism.tensor_parallel_degree" in proc.stdout
