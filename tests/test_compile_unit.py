"""apply_compile / compile_loss / compile_forward_loss on one process with cheap backends: what
gets compiled, that it matches eager, that state-dict names survive, and that [compile] keys
take effect."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallel.compile import apply_compile, compile_forward_loss, compile_loss
from trainer.config import Compile

DIM, VOCAB, SEQ = 16, 32, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.mlp(x)


class TinyLM(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_blocks)})
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.out(x)


def loss_fn(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled code is cached per code object, so each test starts from an empty cache; the
    recompile limit, which apply_compile sets globally, is restored afterwards."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        yield
    torch._dynamo.reset()


def _cfg(**kw):
    return Compile(**{"enable": True, "backend": "aot_eager", **kw})


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def _step(model, loss=loss_fn, forward_loss=None):
    tokens, labels = _data()
    value = forward_loss(tokens, labels) if forward_loss else loss(model(tokens), labels)
    value.backward()
    return value.detach(), {n: p.grad for n, p in model.named_parameters()}


def _model():
    torch.manual_seed(0)
    return TinyLM()


class CountingBackend:
    """A torch.compile backend that runs the graph eagerly and counts compilations."""

    def __init__(self):
        self.graphs = 0
        self.code = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.code.append(gm.code)
        return gm.forward


@pytest.mark.parametrize("strategy,components,reuse", [
    ("blocks", ["model", "loss"], False),
    ("model", ["model", "loss"], False),
    ("model", ["model"], False),
    ("model", ["model", "loss"], True),
])
def test_compiled_matches_eager_and_keeps_names(strategy, components, reuse):
    ref = _model()
    model = copy.deepcopy(ref)
    cfg = _cfg(strategy=strategy, components=components)
    assert apply_compile(model, model.layers, cfg, reuse_blocks=reuse) is model
    forward_loss = compile_forward_loss(model, loss_fn, cfg)
    loss_ref, grads_ref = _step(ref)
    loss, grads = _step(model, forward_loss=forward_loss)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-6, msg=name)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert type(model) is TinyLM
    assert all(isinstance(b, Block) and (type(b) is Block) != reuse for b in model.layers.values())


def _schema_generations(n_blocks, monkeypatch):
    """How many times a nested block region's schema is generated while compiling and training
    one step of a model of `n_blocks` reused blocks (checked against eager on the way)."""
    from torch._higher_order_ops.schema import HopSchemaGenerator

    count = {"n": 0}
    generate = HopSchemaGenerator.gen_schema

    def counting(self):
        count["n"] += 1
        return generate(self)

    monkeypatch.setattr(HopSchemaGenerator, "gen_schema", counting)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = TinyLM(n_blocks)
    model = copy.deepcopy(ref)
    cfg = _cfg(strategy="model")
    apply_compile(model, model.layers, cfg, reuse_blocks=True)
    loss_ref, grads_ref = _step(ref)
    loss, grads = _step(model, forward_loss=compile_forward_loss(model, loss_fn, cfg))
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-6, msg=name)
    return count["n"]


def test_nested_region_schema_is_generated_once_per_compile_not_per_block(monkeypatch):
    """parallel/torch_internals.memoize_nested_region_schemas: without it torch 2.13 generates
    (and re-traces the block for) the region's schema on every call, two per block."""
    shallow, deep = _schema_generations(2, monkeypatch), _schema_generations(6, monkeypatch)
    assert shallow == deep
    assert deep < 6


def test_eager_backend_traces_blocks_inline():
    """Dynamo's eager backend runs no AOTAutograd, under which a nested compile region's
    backward fails on torch 2.13; the blocks are then traced inline and training works."""
    ref = _model()
    model = copy.deepcopy(ref)
    cfg = _cfg(strategy="model", backend="eager")
    apply_compile(model, model.layers, cfg, reuse_blocks=True)
    assert all(type(b) is Block for b in model.layers.values())
    loss_ref, grads_ref = _step(ref)
    loss, grads = _step(model, forward_loss=compile_forward_loss(model, loss_fn, cfg))
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-6, msg=name)


def test_blocks_strategy_compiles_each_block_only():
    model = _model()
    apply_compile(model, model.layers, _cfg(strategy="blocks"))
    assert all(b._compiled_call_impl is not None for b in model.layers.values())
    assert model._compiled_call_impl is None


def test_blocks_strategy_works_on_module_list():
    model = nn.Sequential(Block(), Block())
    apply_compile(model, model, _cfg(strategy="blocks"))
    assert all(b._compiled_call_impl is not None for b in model)


def test_blocks_strategy_is_fullgraph():
    class Breaks(nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    container = nn.ModuleList([Breaks()])
    apply_compile(container, container, _cfg(strategy="blocks"))
    with pytest.raises(Exception, match="graph_break"):
        container[0](torch.ones(2))


def test_model_strategy_is_one_region():
    model = _model()
    backend = CountingBackend()
    apply_compile(model, model.layers, _cfg(strategy="model", backend=backend, components=["model"]))
    assert model._compiled_call_impl is not None
    assert all(b._compiled_call_impl is None for b in model.layers.values())
    _step(model)
    assert backend.graphs == 1


def test_model_and_loss_are_one_graph():
    """With "model" and "loss" in components the model is not compiled on its own: one graph
    holds the model and the cross-entropy."""
    model = _model()
    backend = CountingBackend()
    cfg = _cfg(strategy="model", backend=backend)
    apply_compile(model, model.layers, cfg)
    assert model._compiled_call_impl is None
    forward_loss = compile_forward_loss(model, loss_fn, cfg, fullgraph=True)
    _step(model, forward_loss=forward_loss)
    assert backend.graphs == 1
    assert "cross_entropy" in backend.code[0] and "embedding" in backend.code[0]


@pytest.mark.parametrize("cfg", [Compile(enable=False), Compile(enable=True, components=["loss"])])
def test_disabled_leaves_model_alone(cfg):
    model = _model()
    apply_compile(model, model.layers, cfg)
    assert model._compiled_call_impl is None
    assert all(b._compiled_call_impl is None for b in model.layers.values())


def test_recompile_limit_is_applied():
    model = _model()
    backend = CountingBackend()
    apply_compile(model, model.layers, _cfg(strategy="blocks", backend=backend, recompile_limit=2))
    assert torch._dynamo.config.recompile_limit == 2
    assert torch._dynamo.config.cache_size_limit == 2
    block = model.layers["0"]
    with torch.no_grad():
        for seq in (4, 5):  # static shapes: every new length is a recompile
            block(torch.randn(1, seq, DIM))
        assert backend.graphs == 2
        # fullgraph=True turns the limit into a hard error instead of a silent eager fallback
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            block(torch.randn(1, 6, DIM))


def test_compile_loss_matches_eager():
    backend = CountingBackend()
    compiled = compile_loss(loss_fn, _cfg(backend=backend))
    assert compiled is not loss_fn
    logits = torch.randn(2, SEQ, VOCAB, requires_grad=True)
    _, labels = _data()
    value = compiled(logits, labels)
    value.backward()
    grad = logits.grad.clone()
    logits.grad = None
    expected = loss_fn(logits, labels)
    expected.backward()
    torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, logits.grad, rtol=0, atol=1e-6)
    assert backend.graphs == 1


@pytest.mark.parametrize("cfg", [Compile(enable=False), Compile(enable=True, components=["model"])])
def test_compile_loss_disabled_returns_same_function(cfg):
    assert compile_loss(loss_fn, cfg) is loss_fn


def test_bad_strategy_raises():
    model = _model()
    with pytest.raises(ValueError, match="compile.strategy"):
        apply_compile(model, model.layers, _cfg(strategy="layers"))
