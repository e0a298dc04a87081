"""torchtitan v0.2.2's shipped Llama 3 TOMLs load unmodified; the key table covers that release's
whole job config, agrees with weft's config and with docs/torchtitan_compat.md."""

import ast
import base64
import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

from tests.dist_utils import ROOT
from trainer import torchtitan_compat as tc
from trainer.config import ConfigError, JobConfig, load_config, load_config_with_notes
from trainer.main import main
from trainer.tokenizer import build_tokenizer

DATA = os.path.join(ROOT, "tests", "data", "torchtitan_v0.2.2")


def toml(name):
    return os.path.join(DATA, f"{name}.toml")


def torchtitan_fields():
    """{dotted key: default} of every field of v0.2.2's JobConfig, read from job_config.py with ast."""
    with open(os.path.join(DATA, "job_config.py")) as f:
        tree = ast.parse(f.read())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def walk(cls, prefix):
        for stmt in classes[cls].body:
            if not isinstance(stmt, ast.AnnAssign):
                continue
            name, value = prefix + stmt.target.id, stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                factory = {k.arg: k.value for k in value.keywords}["default_factory"]
                if isinstance(factory, ast.Name) and factory.id in classes:
                    yield from walk(factory.id, name + ".")
                else:
                    yield name, [] if isinstance(factory, ast.Name) else ast.literal_eval(factory.body)
            else:
                yield name, ast.literal_eval(value)

    return dict(walk("JobConfig", ""))


def weft_keys():
    hints = typing.get_type_hints(JobConfig)
    return {f"{s.name}.{k}" for s in dataclasses.fields(JobConfig) for k in typing.get_type_hints(hints[s.name])}


def test_table_is_every_v0_2_2_key_with_its_default():
    fields = torchtitan_fields()
    assert len(fields) == 149
    assert list(tc.TABLE) == list(fields)  # every key, in job_config.py's order (the docs' order)
    for key, entry in tc.TABLE.items():
        if entry.action == tc.NEUTRAL_ACTION:
            assert fields[key] == entry.default and type(fields[key]) is type(entry.default), key
            assert entry.accepts(entry.default, gate_off=False), f"{key}: torchtitan's default must be neutral"


def test_table_agrees_with_weft_config():
    weft = weft_keys()
    for key, entry in tc.TABLE.items():
        if entry.action == tc.SUPPORTED_ACTION:
            assert key in weft, f"{key} is marked supported but trainer/config.py lacks it"
        else:
            assert key not in weft, f"weft has {key}: mark it SUPPORTED in trainer/torchtitan_compat.py"
        if entry.action == tc.ALIAS_ACTION:
            assert entry.target in weft, key
        if entry.gate is not None:
            assert entry.gate[0] in tc.TABLE, key


def test_doc_is_generated_from_table():
    proc = subprocess.run([sys.executable, "scripts/torchtitan_compat_doc.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def write_tiktoken(path):
    """A tiny valid tiktoken BPE file: the 256 single bytes, rank = byte value."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256))
    return path


def test_debug_model_loads_with_its_assets_mapped():
    cfg, notes = load_config_with_notes(["--job.config_file", toml("debug_model")])
    assert cfg.training.dataset == "stdlib" and cfg.model.hf_assets_path == "" and cfg.model.tokenizer_path == ""
    assert cfg.parallelism.fsdp_reshard_after_forward == "default" and cfg.checkpoint.model_only_final is False
    assert cfg.activation_checkpoint.selective_ac_option == "2" and cfg.validation.freq == 5
    assert sum("c4_test" in n for n in notes) == 1 and sum("tests/assets/tokenizer" in n for n in notes) == 1
    (ignored,) = [n for n in notes if n.startswith("torchtitan keys accepted")]
    for shown in ('job.print_config = false', 'metrics.enable_wandb = false',
                  'parallelism.pipeline_parallel_schedule = "Interleaved1F1B"', 'validation.dataset = "c4_validation"',
                  'quantize.linear.float8.filter_fqns = ["output"]'):
        assert shown in ignored


@pytest.mark.parametrize("name, world, tp, layout", [
    ("llama3_8b", 64, 1, "tokenizer.model"),
    ("llama3_70b", 64, 8, os.path.join("original", "tokenizer.model")),
])
def test_large_configs_pass_the_config_check(tmp_path, monkeypatch, capsys, name, world, tp, layout):
    assets = tmp_path / "assets"
    write_tiktoken(str(assets / layout))
    monkeypatch.setenv("WEFT_CHECK_CONFIG_ONLY", "1")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    rc = main(["--job.config_file", toml(name), "--model.hf_assets_path", str(assets),
               "--job.dump_folder", str(tmp_path / "dump")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    lines = out.out.splitlines()
    (ignored,) = [line for line in lines if "torchtitan keys accepted at neutral values and ignored" in line]
    assert "data_parallel_replicate_degree" not in ignored  # weft has HSDP
    for shown in ("parallelism.pipeline_parallel_degree = 1",
                  "parallelism.context_parallel_degree = 1", "quantize.linear.float8.enable_fsdp_float8_all_gather = false",
                  'validation.dataset = "c4_validation"'):
        assert shown in ignored
    assert any('"allenai/c4:en"' in line for line in lines)
    cfg = load_config(["--job.config_file", toml(name), "--model.hf_assets_path", str(assets)])
    assert cfg.parallelism.tensor_parallel_degree == tp and cfg.checkpoint.model_only_final is True
    assert cfg.validation.steps == 1200 and cfg.training.dataset == "allenai/c4:en"


def test_405b_is_refused_in_one_error_naming_every_unsupported_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "128")
    rc = main(["--job.config_file", toml("llama3_405b"), "--job.dump_folder", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("weft: config error: torchtitan keys")
    for key in ('model.converters = ["float8"]', "parallelism.enable_async_tensor_parallel = true",
                "quantize.linear.float8.enable_fsdp_float8_all_gather = true",
                "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp = true"):
        assert key in err
    assert "training.mixed_precision_param" in err  # what weft offers instead


def test_pipeline_parallel_variant_is_refused(tmp_path):
    text = open(toml("debug_model")).read().replace("pipeline_parallel_degree = 1", "pipeline_parallel_degree = 2")
    (tmp_path / "pp.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", str(tmp_path / "pp.toml")])
    assert "parallelism.pipeline_parallel_degree = 2" in str(e.value)
    assert "data_parallel_shard_degree x tensor_parallel_degree" in str(e.value)
    # the command line can set it back to its neutral value
    load_config(["--job.config_file", str(tmp_path / "pp.toml"), "--parallelism.pipeline_parallel_degree", "1"])


def test_aliases_flags_and_unknown_keys(tmp_path):
    cfg = load_config(["--debug.seed", "7", "--debug.deterministic", "--parallelism.disable_loss_parallel",
                       "--checkpoint.last_save_model_only", "true"])
    assert cfg.training.seed == 7 and cfg.training.deterministic is True
    assert cfg.parallelism.enable_loss_parallel is False and cfg.checkpoint.model_only_final is True
    assert load_config(["--parallelism.no-disable_loss_parallel"]).parallelism.enable_loss_parallel is True
    with pytest.raises(ConfigError, match="parallelism.enable_async_tensor_parallel = true"):
        load_config(["--parallelism.enable_async_tensor_parallel"])  # a bare torchtitan flag
    path = tmp_path / "c.toml"
    path.write_text("[training]\nseed = 1\n[debug]\nseed = 2\n")
    with pytest.raises(ConfigError, match="'training.seed' = 1 and 'debug.seed' = 2"):
        load_config(["--job.config_file", str(path)])
    path.write_text("[quantize.linear.float8]\nenable_fsdp_float8_allgather = false\n")
    with pytest.raises(ConfigError, match="Did you mean 'quantize.linear.float8.enable_fsdp_float8_all_gather'"):
        load_config(["--job.config_file", str(path)])
    with pytest.raises(ConfigError, match="Did you mean 'parallelism.pipeline_parallel_degree'"):
        load_config(["--parallelism.pipeline_parallel_degre", "1"])
    path.write_text("[training.dataloader]\nnum_workers = 0\nprefetch_factor = 4\n")
    assert load_config(["--job.config_file", str(path)]).training.dataset == "stdlib"  # inert without workers
    path.write_text("[training.dataloader]\nnum_workers = 4\n")
    with pytest.raises(ConfigError, match="training.dataloader.num_workers = 4"):
        load_config(["--job.config_file", str(path)])


def test_hf_assets_path_finds_the_tiktoken_file(tmp_path):
    top, nested = tmp_path / "a", tmp_path / "b"
    write_tiktoken(str(top / "tokenizer.model"))
    write_tiktoken(str(nested / "original" / "tokenizer.model"))
    assert build_tokenizer("", str(top)).n_words == 257
    assert build_tokenizer("", str(nested)).n_words == 257
    assert build_tokenizer(str(nested), "").n_words == 257  # a folder as model.tokenizer_path
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps({"model": {}}))
    with pytest.raises(ConfigError, match="model.hf_assets_path .* holds neither tokenizer.model"):
        build_tokenizer("", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="model.hf_assets_path .* does not exist"):
        build_tokenizer("", str(tmp_path / "missing"))


def test_debug_model_trains_three_steps_on_cpu(tmp_path):
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "train.py", "--job.config_file", toml("debug_model"), "--training.seq_len", "256",
         "--training.local_batch_size", "2", "--training.steps", "3", "--job.dump_folder", str(dump)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("torchtitan keys accepted at neutral values and ignored") == 1
    assert proc.stdout.count("c4_test") == 1
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in records)
    saved = load_config(["--job.config_file", str(dump / "config.toml")])  # only weft keys are saved
    assert saved.training.dataset == "stdlib" and saved.training.steps == 3
