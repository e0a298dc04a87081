"""Hugging Face weights out and in: names, RoPE rows, config.json, shards, and the trainer's initial load.

Round trips use the real tinymodel in fp32: exported, then loaded into a model initialized from
another seed, must give the source's logits within 1e-6 (one process here; a 2x2 FSDP x TP mesh
through the trainer in `test_trainer_starts_from_hf_weights_on_2x2_and_resume_wins`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.llama3.args import flavor_args
from models.llama3.hf import halves_to_interleaved, hf_adapter, interleaved_to_halves
from models.llama3.model import Transformer
from tests.dist_utils import ROOT, run_distributed
from tests.test_parallel_parity import BASE
from trainer.checkpoint import CheckpointError, CheckpointManager
from trainer.config import Checkpoint, ConfigError
from trainer.export import INDEX_FILE, export_hf
from trainer.initial_load import load_hf_weights, resolve_initial_load

TOL = dict(rtol=1e-6, atol=1e-6)


def tiny(seed: int, vocab_size: int = 512, **changes) -> Transformer:
    args = dataclasses.replace(flavor_args("tinymodel", vocab_size=vocab_size, max_seq_len=32), **changes)
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


def logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)


def folder_tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


# ---------------------------------------------------------------- the Llama adapter


def _rope_interleaved(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama reference RoPE: rotate (x[2i], x[2i+1]) as a complex number. x: (seq, heads, hd)."""
    seq, _, hd = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    xc = torch.view_as_complex(x.double().reshape(seq, -1, hd // 2, 2))
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)[:, None, :]).reshape(x.shape)


def _rope_rotate_half(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF Llama RoPE: x * cos + rotate_half(x) * sin, halves paired."""
    seq, _, hd = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    emb = torch.cat([angles, angles], dim=-1)[:, None, :]
    x = x.double()
    rotated = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_permuted_wq_wk_give_same_attention_under_hf_rope_and_invert_per_head():
    torch.manual_seed(0)
    dim, n_heads, n_kv, hd, seq = 32, 4, 2, 8, 5
    wq, wk = torch.randn(n_heads * hd, dim), torch.randn(n_kv * hd, dim)
    x = torch.randn(seq, dim)
    ours_q = _rope_interleaved((x @ wq.T).view(seq, n_heads, hd), 1e4)
    ours_k = _rope_interleaved((x @ wk.T).view(seq, n_kv, hd), 1e4)
    hf_q = _rope_rotate_half((x @ interleaved_to_halves(wq, hd).T).view(seq, n_heads, hd), 1e4)
    hf_k = _rope_rotate_half((x @ interleaved_to_halves(wk, hd).T).view(seq, n_kv, hd), 1e4)
    # Same vectors, only the order inside each head differs: even dims first, then odd.
    order = torch.cat([torch.arange(0, hd, 2), torch.arange(1, hd, 2)])
    torch.testing.assert_close(hf_q, ours_q[..., order])
    torch.testing.assert_close(hf_k, ours_k[..., order])
    kv = torch.arange(n_heads) // (n_heads // n_kv)
    scores_ours = torch.einsum("shd,thd->hst", ours_q, ours_k[:, kv])
    scores_hf = torch.einsum("shd,thd->hst", hf_q, hf_k[:, kv])
    torch.testing.assert_close(scores_hf, scores_ours)
    assert not torch.allclose(_rope_rotate_half((x @ wq.T).view(seq, n_heads, hd), 1e4), ours_q[..., order])
    # The inverse restores the rows, and both act on any block of whole heads alone.
    assert torch.equal(halves_to_interleaved(interleaved_to_halves(wq, hd), hd), wq)
    assert torch.equal(interleaved_to_halves(wq[hd:3 * hd], hd), interleaved_to_halves(wq, hd)[hd:3 * hd])
    assert torch.equal(wk[1:8:2], interleaved_to_halves(wk, hd)[4:8])  # kv head 0: even rows, then odd


def test_names_config_and_config_checks():
    model = tiny(0)
    adapter = hf_adapter(model.args)
    names = {adapter.hf_name(n) for n in model.state_dict()}
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(model.args.n_layers):
        expected |= {f"model.layers.{i}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm")}
    assert names == expected and len(names) == len(model.state_dict())
    assert adapter.hf_name("layers.1.feed_forward.w3.weight") == "model.layers.1.mlp.up_proj.weight"
    assert adapter.hf_name("layers.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_adapter(dataclasses.asdict(model.args)).args == model.args  # from a checkpoint's fingerprint

    config = adapter.hf_config(dtype=torch.bfloat16, vocab_size=500)
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 192, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 8)
    assert (config["vocab_size"], config["torch_dtype"], config["tie_word_embeddings"]) == (500, "bfloat16", False)
    assert "rope_scaling" not in config
    llama31 = hf_adapter(flavor_args("8B", vocab_size=128256, max_seq_len=8192)).hf_config(dtype=torch.bfloat16)
    assert llama31["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert llama31["vocab_size"] == 128256 and llama31["rope_theta"] == 500000.0

    assert adapter.config_problems(config) == ([], [])
    errors, warnings = adapter.config_problems({**config, "num_attention_heads": 4, "rope_theta": 1e4})
    assert errors == ["num_attention_heads is 4, this model has 8"]
    assert warnings == ["rope_theta is 10000.0, this model uses 500000.0"]
    # transformers v5 writes rope_parameters instead of rope_theta / rope_scaling.
    v5 = {k: v for k, v in llama31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 500000.0, **llama31["rope_scaling"]}
    llama31_adapter = hf_adapter(flavor_args("8B", vocab_size=128256, max_seq_len=8192))
    assert llama31_adapter.config_problems(v5) == ([], [])
    assert llama31_adapter.config_problems({**v5, "rope_parameters": {"rope_theta": 500000.0}})[1] == [
        f"RoPE scaling is None, this model uses {llama31['rope_scaling']}"]
    assert adapter.config_problems({"model_type": "mistral"})[0][0].startswith("model_type is 'mistral'")


# ---------------------------------------------------------------- export and load, one process


def test_sharded_export_round_trips_with_index(tmp_path):
    source = tiny(0)
    adapter = hf_adapter(source.args)
    export_hf(source.state_dict(), adapter, str(tmp_path / "sharded"), max_shard_bytes=100_000)
    export_hf(source.state_dict(), adapter, str(tmp_path / "single"))

    assert sorted(os.listdir(tmp_path / "single")) == ["config.json", "model.safetensors"]
    files = sorted(n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors"))
    assert len(files) == 6 and files[0] == "model-00001-of-00006.safetensors"
    index = json.loads((tmp_path / "sharded" / INDEX_FILE).read_text())
    single = load_file(str(tmp_path / "single" / "model.safetensors"))
    assert index["weight_map"].keys() == single.keys()
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single.values())
    for file in files:
        with safe_open(str(tmp_path / "sharded" / file), framework="pt") as f:
            assert set(f.keys()) == {k for k, v in index["weight_map"].items() if v == file}
            assert f.metadata() == {"format": "pt"}
    for name, tensor in folder_tensors(tmp_path / "sharded").items():
        assert torch.equal(tensor, single[name])
    hk, wk = single["model.layers.0.self_attn.k_proj.weight"], source.state_dict()["layers.0.attention.wk.weight"]
    assert torch.equal(hk, interleaved_to_halves(wk, 8)) and not torch.equal(hk, wk)

    fresh = tiny(1)
    tokens = torch.randint(0, 512, (2, 32))
    assert not torch.allclose(logits(fresh, tokens), logits(source, tokens), **TOL)
    load_hf_weights(fresh, adapter, str(tmp_path / "sharded"), vocab_size=512)
    torch.testing.assert_close(logits(fresh, tokens), logits(source, tokens), **TOL)
    for name, tensor in source.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_trimmed_bf16_export_and_padded_vocab_load(tmp_path):
    source = tiny(0)
    adapter = hf_adapter(source.args)
    export_hf(source.state_dict(), adapter, str(tmp_path / "hf"), dtype=torch.bfloat16, vocab_size=500)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (500, 64) and tensors["lm_head.weight"].shape == (500, 64)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["torch_dtype"]) == (500, "bfloat16")

    fresh = tiny(1)
    with pytest.raises(CheckpointError, match=r"\[500, 64\] in the checkpoint, \[512, 64\] in this model"):
        load_hf_weights(fresh, adapter, str(tmp_path / "hf"), vocab_size=501)  # the tokenizer needs 501 rows
    load_hf_weights(fresh, adapter, str(tmp_path / "hf"), vocab_size=500)
    sd = fresh.state_dict()
    for name in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(sd[name][:500], source.state_dict()[name][:500].bfloat16().float())
        assert not sd[name][500:].any()  # padding rows the checkpoint lacks start at zero
    wq = "layers.1.attention.wq.weight"
    assert torch.equal(sd[wq], source.state_dict()[wq].bfloat16().float())


def test_tied_embeddings_load_the_head_from_the_embedding(tmp_path):
    source = tiny(0)
    adapter = hf_adapter(source.args)
    export_hf(source.state_dict(), adapter, str(tmp_path / "hf"))
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    config_path = tmp_path / "hf" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": True}))
    fresh = tiny(1)
    load_hf_weights(fresh, adapter, str(tmp_path / "hf"), vocab_size=512)
    assert torch.equal(fresh.output.weight, source.tok_embeddings.weight)


def test_load_refuses_what_does_not_fit(tmp_path):
    source = tiny(0)
    export_hf(source.state_dict(), hf_adapter(source.args), str(tmp_path / "hf"))
    other = tiny(1, dim=128)
    with pytest.raises(CheckpointError, match="hidden_size is 64, this model has 128"):
        load_hf_weights(other, hf_adapter(other.args), str(tmp_path / "hf"), vocab_size=512)
    (tmp_path / "hf" / "config.json").unlink()  # without config.json the shapes still catch it
    with pytest.raises(CheckpointError, match=r"another shape: \d+ tensors differ \(e\.g\. model\.embed_tokens"):
        load_hf_weights(other, hf_adapter(other.args), str(tmp_path / "hf"), vocab_size=512)
    smaller_vocab = tiny(1, vocab_size=256)
    with pytest.raises(CheckpointError, match=r"\[512, 64\] in the checkpoint, \[256, 64\] in this model"):
        load_hf_weights(smaller_vocab, hf_adapter(smaller_vocab.args), str(tmp_path / "hf"), vocab_size=256)
    with pytest.raises(CheckpointError, match="is not a folder"):
        load_hf_weights(source, hf_adapter(source.args), str(tmp_path / "nowhere"), vocab_size=512)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no \\*.safetensors"):
        load_hf_weights(source, hf_adapter(source.args), str(tmp_path / "empty"), vocab_size=512)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks 1 tensors .*model.layers.1.mlp.down_proj.weight"):
        load_hf_weights(source, hf_adapter(source.args), str(tmp_path / "hf"), vocab_size=512)


def test_initial_load_keys():
    assert resolve_initial_load("", False, True) is None
    assert resolve_initial_load("/m", True, True) == "/m"
    with pytest.raises(ConfigError, match="needs checkpoint.initial_load_path"):
        resolve_initial_load("", True, True)
    with pytest.raises(ConfigError, match="Set checkpoint.initial_load_in_hf = true"):
        resolve_initial_load("/m", False, True)
    with pytest.raises(ConfigError, match="initial_load_model_only = false"):
        resolve_initial_load("/m", True, False)


def test_convert_script_matches_direct_export(tmp_path):
    source = tiny(0)
    opt = torch.optim.AdamW(source.parameters())
    mgr = CheckpointManager(Checkpoint(enable=True, folder="ckpt"), dump_folder=str(tmp_path), model=source,
                            optimizer=opt, lr_scheduler=None, dataloader=None,
                            model_fingerprint=dataclasses.asdict(source.args))
    mgr.save(1)
    convert = runpy.run_path(os.path.join(ROOT, "scripts", "convert_to_hf.py"))["main"]
    step = str(tmp_path / "ckpt" / "step-1")
    assert convert([step, str(tmp_path / "conv"), "--vocab-size", "500", "--dtype", "bfloat16"]) == 0
    export_hf(source.state_dict(), hf_adapter(source.args), str(tmp_path / "direct"), vocab_size=500,
              dtype=torch.bfloat16)
    assert sorted(os.listdir(tmp_path / "conv")) == sorted(os.listdir(tmp_path / "direct"))
    assert (tmp_path / "conv" / "config.json").read_text() == (tmp_path / "direct" / "config.json").read_text()
    conv, direct = folder_tensors(tmp_path / "conv"), folder_tensors(tmp_path / "direct")
    assert conv.keys() == direct.keys() and all(torch.equal(conv[k], direct[k]) for k in conv)
    # A second conversion replaces the earlier export; a folder with other files is refused.
    assert convert([step, str(tmp_path / "conv")]) == 0
    assert load_file(str(tmp_path / "conv" / "model.safetensors"))["lm_head.weight"].shape == (512, 64)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit):
        convert([step, str(tmp_path / "mine")])
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- through the trainer, sharded


def _run_from_hf(rank, world_size, dump, corpus, hf_dir, other_hf_dir, tokens_path, out_path):
    from torch.distributed.tensor import DTensor

    from trainer.config import load_config
    from trainer.run import resolve_run
    from trainer.trainer import Trainer

    def run(initial: str) -> torch.Tensor:
        cfg = load_config(BASE + [
            "--training.dataset_path", corpus, "--job.dump_folder", dump, "--training.steps", "1",
            "--optimizer.lr", "0", "--training.seed", "7", "--parallelism.tensor_parallel_degree", "2",
            "--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.export_hf",
            "--checkpoint.initial_load_path", initial, "--checkpoint.initial_load_in_hf",
        ])
        trainer = Trainer(resolve_run(cfg, world_size))
        trainer.train()
        with torch.no_grad():
            out = trainer.model(torch.load(tokens_path))
        trainer.close()
        return out.full_tensor() if isinstance(out, DTensor) else out

    # Run 1 starts from hf_dir, trains one step at lr 0 (weights unchanged), saves and exports.
    # Run 2 finds that checkpoint: it resumes from it and ignores its other initial_load_path.
    first, second = run(hf_dir), run(other_hf_dir)
    if rank == 0:
        torch.save({"first": first, "second": second}, out_path)


def test_trainer_starts_from_hf_weights_on_2x2_and_resume_wins(tmp_path, corpus):
    from trainer.config import load_config
    from trainer.run import resolve_run

    run = resolve_run(load_config(BASE), 1)
    tokenizer, args = run.tokenizer, run.model_args
    adapter = hf_adapter(args)
    torch.manual_seed(0)
    source = Transformer(args)
    source.init_weights()
    export_hf(source.state_dict(), adapter, str(tmp_path / "hf"), vocab_size=tokenizer.n_words,
              max_shard_bytes=20_000_000)
    torch.manual_seed(1)
    other = Transformer(args)
    other.init_weights()
    export_hf(other.state_dict(), adapter, str(tmp_path / "other"), vocab_size=tokenizer.n_words)
    assert len(json.loads((tmp_path / "hf" / INDEX_FILE).read_text())["weight_map"]) == len(source.state_dict())
    tokens = torch.randint(0, tokenizer.n_words, (2, 32))
    torch.save(tokens, tmp_path / "tokens.pt")

    dump = str(tmp_path / "run")
    run_distributed(_run_from_hf, 4, dump, corpus, str(tmp_path / "hf"), str(tmp_path / "other"),
                    str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"))
    got = torch.load(tmp_path / "logits.pt")
    # Vocabulary rows past the tokenizer are not exported, so they load as zero: compare the rest.
    reference = logits(source, tokens)[..., : tokenizer.n_words]
    torch.testing.assert_close(got["first"][..., : tokenizer.n_words], reference, **TOL)
    torch.testing.assert_close(got["second"][..., : tokenizer.n_words], reference, **TOL)
    # The 2x2 mesh's streamed export at the end equals the source export, bit for bit.
    exported, expected = folder_tensors(os.path.join(dump, "checkpoint", "hf")), folder_tensors(tmp_path / "hf")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert json.loads(open(os.path.join(dump, "checkpoint", "hf", "config.json")).read()) == config
