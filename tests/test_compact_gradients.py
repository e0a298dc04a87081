"""Compact gradients at dp = 1 (parallel/compact_gradients.py): less memory, the same update.

The tiny model (512-row vocabulary) with fp32 master weights cast to bf16 at use trains 3
AdamW steps twice from the same weights and batches: with the gradients autograd leaves in
fp32 `.grad`, and with them held in bf16 until the step, which widens them a group at a time.
A gradient computed in bf16 and widened is exactly a bf16 value, so the parameters must come
out bitwise equal, with clipping active (max_norm below the norms), with the foreach and the
fused (clip folded in) AdamW.
"""

import pytest
import torch

STEPS = 3
VOCAB = 512


def _model():
    from models.llama3.args import flavor_args
    from models.llama3.model import Transformer
    from parallel.data_parallel import apply_compute_dtype
    from parallel.init import sharded_init_normal_
    from parallel.parameter_views import stored_parameters

    args = flavor_args("tinymodel", vocab_size=VOCAB, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    apply_compute_dtype(model, torch.bfloat16)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with stored_parameters():
        model.init_weights(sharded_init_normal_)
    return model


def _train(compact: bool, fused: bool, seen: dict, copies: bool = False) -> tuple[list[torch.Tensor], list[float]]:
    from parallel.data_parallel import compact_gradients
    from trainer.optim import clip_and_step

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    held = compact_gradients(model, torch.bfloat16, keep_copies=copies) if compact else None
    data = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 33), generator=data)
        if held is not None:
            held.refresh_copies()  # as the trainer does before each forward
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        if held is not None:
            seen["held"] = [(tuple(g.shape), g.dtype) for g in held.gradients()]
            seen["sink bytes"] = sum(s.untyped_storage().nbytes() for s in held.sinks.values())
            seen["fp32 .grad"] = [n for n, p in model.named_parameters() if p.grad is not None]
        norms.append(clip_and_step(optimizer, model.parameters(), max_norm=0.05, compact=held).item())
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
def test_compact_gradients_step_bitwise_like_fp32_grads(fused, monkeypatch):
    import parallel.compact_gradients as compact_gradients

    # Groups of at most 64 KiB of fp32 gradient: the tiny model's step runs in many groups.
    monkeypatch.setattr(compact_gradients, "GROUP_BYTES", 64 * 1024)
    seen = {}
    reference, reference_norms = _train(False, fused, {})
    params, norms = _train(True, fused, seen)
    assert min(norms) > 0.05, "clipping must be active for the test to cover it"
    assert norms == reference_norms
    for got, want in zip(params, reference):
        assert torch.equal(got, want)
    model = _model()
    cast = [(tuple(p.shape), torch.bfloat16) for n, p in model.named_parameters() if n != "tok_embeddings.weight"]
    assert seen["held"] == cast  # every cast parameter's gradient, in bf16, full shape
    assert seen["sink bytes"] == 2 * len(cast)  # one bf16 element of storage per sink
    assert seen["fp32 .grad"] == ["tok_embeddings.weight"]  # its fp32 lookup sums rows in fp32


def test_weight_copies_train_bitwise_like_casts():
    """Forward reading kept bf16 copies (refreshed after each step of torch's AdamW, whose
    in-place writes move the parameters' version counters) trains bit for bit as casting at
    use; a copy left stale would change the losses from the second step on."""
    cast, cast_norms = _train(True, False, {})
    seen = {}
    copied, copied_norms = _train(True, False, seen, copies=True)
    assert copied_norms == cast_norms
    assert all(torch.equal(got, want) for got, want in zip(copied, cast))
    assert seen["sink bytes"] > 0  # the sinks hold the copies: real storage, not one element each


def test_weight_copies_are_what_forward_reads_and_follow_in_place_writes():
    from parallel.data_parallel import compact_gradients
    from parallel.parameter_views import stored_parameters

    model = _model()
    held = compact_gradients(model, torch.bfloat16, keep_copies=True)
    held.refresh_copies()
    linear = model.layers["0"].attention.wq
    assert linear.weight is held.sinks[linear._parameters["weight"]]  # read as it is: no cast
    assert torch.equal(linear.weight, linear._parameters["weight"].to(torch.bfloat16))
    with torch.no_grad(), stored_parameters():
        linear.weight.mul_(2)  # e.g. a checkpoint load: a write torch counts
    assert not torch.equal(linear.weight, linear._parameters["weight"].to(torch.bfloat16))
    held.refresh_copies()
    assert torch.equal(linear.weight, linear._parameters["weight"].to(torch.bfloat16))


def test_step_groups_bound_the_widened_bytes():
    from parallel.compact_gradients import GROUP_BYTES, step_groups

    params = [torch.nn.Parameter(torch.empty(n, device="meta")) for n in (1 << 27, 1 << 27, 3 << 27, 1 << 26, 1 << 26)]
    groups = step_groups(params)
    assert [len(g) for g in groups] == [2, 1, 2]  # 1 GiB, then 1.5 GiB alone, then 0.5 GiB
    assert [p for g in groups for p in g] == params
    assert max(sum(p.numel() * 4 for p in g) for g in groups if len(g) > 1) <= GROUP_BYTES


def test_dry_run_counts_compact_gradients():
    """The planner counts 2 bytes per compact gradient and, for an optimizer that reads fp32
    gradients, the largest widened group at the step."""
    from trainer.config import load_config
    from trainer.dry_run import format_plan, plan

    argv = ["--job.config_file", "train_configs/llama3_8b.toml", "--comm.mode", "fake_backend",
            "--activation_checkpoint.mode", "full", "--optimizer.implementation", "fused"]
    plain = format_plan(plan(load_config(argv), 1))
    compact = format_plan(plan(load_config([*argv, "--training.compact_gradients", "true"]), 1))
    read_as_held = format_plan(plan(load_config([*argv, "--training.compact_gradients", "true",
                                                 "--optimizer.implementation", "triton"]), 1))
    total, table = 8_030_261_248, 128_256 * 4_096  # 8B's parameters, the embedding table's
    assert f"gradients                 {4 * total:,} B" in plain
    assert "backward: the end            119.66 GiB  <- peak" in plain
    # All but the embedding table (looked up in fp32, its rows summed in fp32) in bf16.
    assert f"gradients                 {2 * (total - table) + 4 * table:,} B" in compact
    assert "widened to fp32 1.96 GiB at a time" in compact  # the head's fp32 gradient, the largest group
    assert "optimizer step               107.64 GiB  <- peak" in compact
    # The Triton AdamW reads them in bf16: no widened group, the step no higher than backward's end.
    assert "read as held by the Triton AdamW" in read_as_held and "widened" not in read_as_held
    assert "backward: the end            105.68 GiB  <- peak" in read_as_held
    assert "optimizer step               105.68 GiB\n" in read_as_held


def test_dry_run_counts_weight_copies_as_state_and_no_kept_casts():
    """3B without AC: the copies are 2 bytes per cast parameter for the whole run, and the casts
    autograd kept for backward are gone from the activations, so the peak stays where it was;
    with blocks offloaded, no copy is counted as moved to the host."""
    from trainer.config import load_config
    from trainer.dry_run import format_plan, plan

    argv = ["--job.config_file", "train_configs/llama3_3b.toml", "--comm.mode", "fake_backend",
            "--activation_checkpoint.mode", "none", "--optimizer.implementation", "triton",
            "--training.compact_gradients", "true"]
    casts = format_plan(plan(load_config(argv), 1))
    copies = format_plan(plan(load_config([*argv, "--training.compute_weight_copies", "true"]), 1))
    total, table = 3_606_752_256, 128_256 * 3_072  # 3B's parameters, the embedding table's

    def activations(plan_text: str) -> int:
        return int(plan_text.split("activations")[1].split(" B")[0].replace(",", ""))

    assert "weight copies" not in casts
    assert f"weight copies              {2 * (total - table):,} B" in copies
    assert activations(casts) - activations(copies) == 2 * (total - table)
    assert "backward: the head            90.64 GiB  <- peak" in casts
    assert "backward: the head            90.64 GiB  <- peak" in copies
    # Two blocks offloaded: their kept casts went to the host with them; copies stay.
    offload = ["--activation_checkpoint.offload_blocks", "2"]
    casts = format_plan(plan(load_config([*argv, *offload]), 1))
    copies = format_plan(plan(load_config([*argv, *offload, "--training.compute_weight_copies", "true"]), 1))
    block = (total - 2 * table - 3_072) // 28  # the untied head is the table's size; the final norm
    assert activations(casts) - activations(copies) == 2 * (total - table) - 2 * 2 * block


def test_training_run_with_compact_gradients_logs_the_same_losses(tmp_path, corpus):
    """train.py at dp = 1 with bf16 compute, eager: the same losses and gradient norms, bit for bit,
    with compact gradients and with weight copies."""
    import json
    import os
    import subprocess
    import sys

    from tests.dist_utils import ROOT

    records = {}
    for compact, copies in (("false", "false"), ("true", "false"), ("true", "true")):
        dump = tmp_path / f"{compact}_{copies}"
        proc = subprocess.run(
            [sys.executable, "train.py", "--job.config_file", "train_configs/debug_model.toml",
             "--model.flavor", "tinymodel", "--training.seq_len", "32", "--training.dataset_path", corpus,
             "--training.steps", "4", "--metrics.log_freq", "1", "--job.dump_folder", str(dump),
             "--training.mixed_precision_param", "bfloat16", "--training.compact_gradients", compact,
             "--training.compute_weight_copies", copies],
            cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert ("compact_gradients = true" in proc.stdout) == (compact == "true")  # the resolved config
        lines = (dump / "metrics.jsonl").read_text().splitlines()
        records[compact, copies] = [(r["loss"], r["grad_norm"]) for r in map(json.loads, lines)]
    assert len(records["true", "false"]) == 4
    assert records["true", "false"] == records["false", "false"]
    # Forward reading kept bf16 weights (recast after each step of the foreach AdamW): the same bits.
    assert records["true", "true"] == records["false", "false"]


def test_compiled_compact_gradients_match_and_reuse_a_warm_cache(tmp_path, corpus, monkeypatch):
    """Compiled per block and as one graph, with compact gradients (and per block with weight
    copies): the losses of fp32 `.grad` within 1e-4 relative, and a second launch on the same
    cache loads the graphs.

    1e-4 and not bitwise: without compact gradients inductor may fuse a norm weight's gradient
    reduction with the cast's widening and skip the rounding to bf16 that FSDP2 (and compact
    gradients) apply; the matmul weights' gradients are bf16 values either way. The cast into
    the sink is a custom autograd.Function, which AOTAutograd caches only when told to
    (parallel/torch_internals.py): without that, the warm launch would miss.
    """
    from tests.test_parallel_parity import BASE, launch

    base = [*BASE, "--training.dataset_path", corpus, "--training.mixed_precision_param", "bfloat16",
            "--training.global_batch_size", "2", "--compile.enable", "true"]
    compact = ["--training.compact_gradients", "true"]
    copies = [*compact, "--training.compute_weight_copies", "true"]
    runs = {"blocks": ["--compile.strategy", "blocks"], "blocks compact": ["--compile.strategy", "blocks", *compact],
            "model compact": ["--compile.strategy", "model", *compact],
            "blocks copies": ["--compile.strategy", "blocks", *copies]}
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    cold, _ = launch(tmp_path, 1, base, list(runs.values()), cache_stats=True)
    warm_runs = [runs["blocks compact"], runs["model compact"], runs["blocks copies"]]
    warm, warm_cache = launch(tmp_path, 1, base, warm_runs, cache_stats=True)
    losses = {name: [r["loss"] for r in cold[" ".join(run)]] for name, run in runs.items()}
    assert cold[" ".join(runs["blocks copies"])][-1]["recompiles_after_warmup"] == 0
    for name in ("blocks compact", "model compact", "blocks copies"):
        assert len(losses[name]) == 5
        for got, want in zip(losses[name], losses["blocks"]):
            assert abs(got - want) <= 1e-4 * abs(want), (name, losses[name], losses["blocks"])
    for run in warm_runs:
        key = " ".join(run)
        assert [r["loss"] for r in warm[key]] == [r["loss"] for r in cold[key]]
        assert warm_cache[key].get("autograd_cache_hit", 0) > 0, (key, warm_cache[key])
        assert warm_cache[key].get("autograd_cache_bypass", 0) == 0, (key, warm_cache[key])


def test_compact_gradients_refuse_gradient_accumulation(tmp_path):
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--training.mixed_precision_param", "bfloat16", "--training.compact_gradients", "true",
                       "--training.local_batch_size", "2", "--training.global_batch_size", "4"])
    with pytest.raises(ConfigError, match="training.compact_gradients holds one micro-batch's gradients"):
        resolve_run(cfg, world_size=1)
    one_micro_batch = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                   str(tmp_path), "--training.mixed_precision_param", "bfloat16",
                                   "--training.compact_gradients", "true"])
    assert resolve_run(one_micro_batch, 1).compact_gradients
    assert not resolve_run(load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder",
                                        str(tmp_path), "--training.compact_gradients", "true"]), 1).compact_gradients


def test_weight_copies_need_compact_gradients(tmp_path):
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.run import resolve_run

    argv = ["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
            "--training.mixed_precision_param", "bfloat16", "--training.compute_weight_copies", "true"]
    with pytest.raises(ConfigError, match="set training.compact_gradients = true as well"):
        resolve_run(load_config(argv), world_size=1)
    assert resolve_run(load_config([*argv, "--training.compact_gradients", "true"]), 1).weight_copies
    # Where compact gradients have no effect (fp32 compute here), neither have the copies.
    fp32 = [*argv, "--training.compact_gradients", "true", "--training.mixed_precision_param", "float32"]
    assert not resolve_run(load_config(fp32), 1).weight_copies
