"""Activation checkpointing: numerics, the op-level save/recompute policy, block selection,
state-dict names, torch.compile, and composition with FSDP2 (2 ranks, gloo)."""

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from parallel.activation_checkpoint import (
    apply_activation_checkpointing,
    checkpoint_kind,
    is_checkpointed,
    op_level_policy,
)
from tests.dist_utils import run_distributed

DIM, HEADS, HIDDEN, SEQ = 16, 2, 24, 8
aten = torch.ops.aten


class Block(nn.Module):
    """norm + causal attention + SwiGLU MLP: five matmuls, in the order qkv, proj, w1, w3, w2."""

    def __init__(self):
        super().__init__()
        self.attn_norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp_norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w3 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).transpose(1, 3).unbind(2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, DIM))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Stack(nn.Module):
    def __init__(self, n_blocks=3, as_dict=False):
        super().__init__()
        blocks = [Block() for _ in range(n_blocks)]
        self.layers = nn.ModuleDict({str(i): b for i, b in enumerate(blocks)}) if as_dict else nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.layers.values() if isinstance(self.layers, nn.ModuleDict) else self.layers:
            x = block(x)
        return x


def _make(n_blocks=3, as_dict=False):
    torch.manual_seed(0)
    return Stack(n_blocks, as_dict), torch.randn(2, SEQ, DIM, requires_grad=True)


def _run(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


class RecomputeLog(TorchDispatchMode):
    """Records the forward-only ops (addmm, attention) that run while it is active.

    Used around backward: there, an addmm or an attention forward can only come from the
    checkpoint's recompute (the backward of a linear uses mm, of attention its own op).
    """

    def __init__(self):
        super().__init__()
        self.addmm_widths, self.attention = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.addmm.default:
            self.addmm_widths.append(out.shape[-1])
        if func is aten._scaled_dot_product_flash_attention_for_cpu.default:
            self.attention += 1
        return out


def _recomputed(model, x):
    out = model(x)
    with RecomputeLog() as log:
        out.sum().backward()
    return log


AC_CONFIGS = [("none", "op"), ("full", "op"), ("selective", "op"), ("selective", "2")]


@pytest.mark.parametrize("mode,option", AC_CONFIGS)
def test_outputs_and_grads_equal_no_ac(mode, option):
    ref, x = _make()
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, mode, option)
    out_ref, dx_ref, grads_ref = _run(ref, x)
    out, dx, grads = _run(model, x)
    assert torch.equal(out, out_ref)
    assert torch.equal(dx, dx_ref)
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name


def test_forward_runs_five_addmm_and_one_attention_per_block():
    # Premise of the recompute tests below: the test block's matmuls dispatch as addmm and
    # its attention as the CPU flash kernel.
    model, x = _make(n_blocks=1)
    with RecomputeLog() as log:
        model(x)
    assert log.addmm_widths == [3 * DIM, DIM, HIDDEN, HIDDEN, DIM]
    assert log.attention == 1


def test_op_level_recomputes_every_other_matmul_and_never_attention():
    n = 3
    model, x = _make(n)
    apply_activation_checkpointing(model.layers, "selective", "op")
    log = _recomputed(model, x)
    # Per block the 2nd (proj) and 4th (w3) matmul are recomputed; the counter restarts in
    # every block. w2's output is not needed by backward, so it is never recomputed.
    assert log.addmm_widths == [DIM, HIDDEN] * n
    assert log.attention == 0


@pytest.mark.parametrize("layout, kinds", [("op_all:2,op:1", ["op_all", "op_all", "op"]),
                                           ("op:1,full:1,none:1", ["op", "full", "none"]),
                                           ("op_all:3", ["op_all"] * 3)])
def test_per_block_layout_checkpoints_each_block_as_it_says(layout, kinds):
    """mode per_block: each block gets its kind; "op_all" blocks recompute no matmul, "op"
    blocks every other one, "full" ones all five (the attention of none); the outputs and
    gradients are no AC's, bit for bit."""
    ref, x = _make(3)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, "per_block", "op", per_block=layout)
    assert [checkpoint_kind(b) for b in model.layers] == kinds
    out_ref, dx_ref, grads_ref = _run(ref, x)
    out, dx, grads = _run(model, x)
    assert torch.equal(out, out_ref) and torch.equal(dx, dx_ref)
    for name, g in grads.items():
        assert torch.equal(g, grads_ref[name]), name
    log = _recomputed(model, x.detach().clone().requires_grad_())
    # backward runs the blocks last to first
    expected = {"op": [DIM, HIDDEN], "op_all": [], "full": [3 * DIM, DIM, HIDDEN, HIDDEN], "none": []}
    assert log.addmm_widths == [w for kind in reversed(kinds) for w in expected[kind]] and log.attention == 0


@pytest.mark.parametrize("layout, needle", [("op:4", "lays out 4 blocks; the model has 3"),
                                            ("op:2", "lays out 2 blocks; the model has 3"),
                                            ("op 3", "must be kind:count"), ("some:3", "must be kind:count"),
                                            ("op:-1,op:4", "must be kind:count"), ("op:\u00b2", "must be kind:count")])
def test_per_block_layout_that_does_not_fit_the_model_raises(layout, needle):
    model, _ = _make(3)
    with pytest.raises(ValueError, match=needle):
        apply_activation_checkpointing(model.layers, "per_block", "op", per_block=layout)


@pytest.mark.parametrize("mode,option", [("full", "op"), ("selective", "1")])
def test_full_recomputes_all_matmuls_but_not_attention(mode, option):
    n = 3
    model, x = _make(n)
    apply_activation_checkpointing(model.layers, mode, option)
    log = _recomputed(model, x)
    # qkv is recomputed too: attention's backward needs its inputs, only its output is kept.
    assert log.addmm_widths == [3 * DIM, DIM, HIDDEN, HIDDEN] * n
    assert log.attention == 0


def test_no_ac_recomputes_nothing():
    model, x = _make()
    log = _recomputed(model, x)
    assert log.addmm_widths == [] and log.attention == 0


def test_policy_saves_collectives_and_counts_forward_and_recompute_apart():
    policy = op_level_policy({"forward": 0, "recompute": 0})
    fwd, rec = types.SimpleNamespace(is_recompute=False), types.SimpleNamespace(is_recompute=True)
    for op in (
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        torch.ops._c10d_functional.all_reduce.default,
        torch.ops._c10d_functional.all_gather_into_tensor.default,
        torch.ops._c10d_functional_autograd.reduce_scatter_tensor.default,
        torch.ops._c10d_functional_autograd.all_gather_into_tensor.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    ):
        assert policy(fwd, op) == CheckpointPolicy.MUST_SAVE, op
    assert policy(fwd, aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(fwd, aten.native_layer_norm.default) == CheckpointPolicy.PREFER_RECOMPUTE
    forward = [policy(fwd, op) for op in (aten.mm.default, aten.bmm.default, aten.addmm.default)]
    recompute = [policy(rec, op) for op in (aten.mm.default, aten.bmm.default, aten.addmm.default)]
    expected = [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_SAVE]
    assert forward == expected and recompute == expected


@pytest.mark.parametrize("every,as_dict", [("1", False), ("2", False), ("3", True), ("7", False)])
def test_selective_n_wraps_every_nth_block(every, as_dict):
    model, _ = _make(n_blocks=6, as_dict=as_dict)
    apply_activation_checkpointing(model.layers, "selective", every)
    blocks = list(model.layers.values()) if as_dict else list(model.layers)
    wrapped = [i for i, b in enumerate(blocks) if is_checkpointed(b)]
    assert wrapped == [i for i in range(6) if (i + 1) % int(every) == 0]


@pytest.mark.parametrize("mode,option", AC_CONFIGS)
def test_state_dict_names_unchanged(mode, option):
    ref, _ = _make(as_dict=True)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, mode, option)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert all(isinstance(b, Block) for b in model.layers.values())
    fresh = Stack(3, as_dict=True)
    apply_activation_checkpointing(fresh.layers, mode, option)
    fresh.load_state_dict(ref.state_dict(), strict=True)
    deep = copy.deepcopy(fresh)  # the copy must run its own parameters, not the original's
    with torch.no_grad():
        deep.layers["0"].w2.bias.add_(1.0)
        assert not torch.equal(deep(torch.ones(1, SEQ, DIM)), fresh(torch.ones(1, SEQ, DIM)))


@pytest.mark.parametrize("option", ["op", "2"])
def test_compiled_block_fullgraph_matches_eager_and_keeps_policy(option):
    torch._dynamo.reset()
    ref, x = _make(n_blocks=2)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, "selective", option)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    out_ref, dx_ref, grads_ref = _run(ref, x)
    out, dx, grads = _run(model, x)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-6, msg=name)
    if option == "op":  # the compiled backward honours the policy
        log = _recomputed(model, x.detach().clone().requires_grad_())
        assert log.addmm_widths == [DIM, HIDDEN] * 2
        assert log.attention == 0


def test_compiled_per_block_layout_compiles_one_graph_per_kind_and_keeps_each_policy():
    """Per-block compile of a mixed layout: every kind is traced (one graph each, none left
    eager at the default recompile limit), the numerics are no AC's, and each compiled block
    recomputes what its kind says."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layout, kinds = "op_all:1,op:1,full:1,none:1", ["op_all", "op", "full", "none"]
    ref, x = _make(n_blocks=4)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, "per_block", "op", per_block=layout)
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
    out_ref, dx_ref, grads_ref = _run(ref, x)
    out, dx, grads = _run(model, x)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == len(kinds)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-6, msg=name)
    log = _recomputed(model, x.detach().clone().requires_grad_())
    expected = {"op": [DIM, HIDDEN], "op_all": [], "full": [3 * DIM, DIM, HIDDEN, HIDDEN], "none": []}
    # a compiled backward recomputes in its own order (the partitioner's), so compare as a multiset
    assert sorted(log.addmm_widths) == sorted(w for kind in kinds for w in expected[kind]) and log.attention == 0


@pytest.mark.parametrize("mode,option", [("partial", "op"), ("selective", "0"), ("selective", "-1"), ("selective", "ops")])
def test_bad_config_raises(mode, option):
    model, _ = _make()
    with pytest.raises(ValueError, match="activation_checkpoint"):
        apply_activation_checkpointing(model.layers, mode, option)


def test_applying_twice_raises():
    model, _ = _make()
    apply_activation_checkpointing(model.layers, "full", "op")
    with pytest.raises(ValueError, match="already activation-checkpointed"):
        apply_activation_checkpointing(model.layers, "selective", "op")


def _fsdp_checks(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    ref, x = _make(n_blocks=2)
    model = copy.deepcopy(ref)
    apply_activation_checkpointing(model.layers, "selective", "op")
    for block in model.layers:
        block.compile(backend="aot_eager", fullgraph=True)
        fully_shard(block)
    fully_shard(model)
    _, _, grads_ref = _run(ref, x)  # full batch on one rank
    local = x.detach().chunk(world_size)[rank]
    out = model(local.requires_grad_())
    (out.square().sum() * world_size).backward()  # FSDP averages over ranks
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), grads_ref[name], rtol=1e-5, atol=1e-5, msg=name)
    assert list(model.state_dict()) == list(ref.state_dict())


def test_composes_with_compile_then_fsdp2():
    run_distributed(_fsdp_checks, 2)
