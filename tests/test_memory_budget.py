"""activation_checkpoint.mode = "memory_budget": config checks, no wrappers, and that the
budget reaches the compiler's partitioner (fewer bytes saved for backward, same numbers)."""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.nn.functional as F
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch import nn
from torch._dynamo.backends.common import aot_autograd

from parallel.activation_checkpoint import apply_activation_checkpointing, is_checkpointed, set_activation_memory_budget
from trainer.config import ConfigError, load_config


@pytest.mark.parametrize("argv, needle", [
    (["--activation_checkpoint.mode", "memory_budget"], "also pass --compile.enable"),
    (["--activation_checkpoint.mode", "memory_budget", "--compile.enable", "--compile.components", "loss"],
     "also pass --compile.enable"),
    (["--activation_checkpoint.memory_budget", "0"], "must be in (0, 1]"),
    (["--activation_checkpoint.memory_budget", "1.5"], "must be in (0, 1]"),
])
def test_config_errors(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert needle in str(e.value)


def test_config_accepts_compiled_budget():
    cfg = load_config(["--activation_checkpoint.mode", "memory_budget", "--compile.enable",
                       "--activation_checkpoint.memory_budget", "0.3"])
    assert (cfg.activation_checkpoint.mode, cfg.activation_checkpoint.memory_budget) == ("memory_budget", 0.3)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x):
        return x + self.w2(F.silu(self.w1(F.rms_norm(x, (32,)))).sin().cos())


def test_no_wrappers():
    blocks = nn.ModuleList([MLP(), MLP()])
    apply_activation_checkpointing(blocks, "memory_budget", "op")
    assert not any(is_checkpointed(b) for b in blocks)


def _saved_bytes_and_grads(budget: float):
    """Compile with the min-cut partitioner (the one inductor uses) under `budget`; return
    the bytes the compiled forward saves for backward, the output and the input grads."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(64, 32, requires_grad=True)
    previous = functorch_config.activation_memory_budget
    set_activation_memory_budget(budget)
    try:
        run_graph = lambda graph, _: make_boxed_func(graph)  # noqa: E731
        backend = aot_autograd(fw_compiler=run_graph, bw_compiler=run_graph,
                               partition_fn=min_cut_rematerialization_partition)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = compiled(x)
        out.sum().backward()
    finally:
        functorch_config.activation_memory_budget = previous
        torch._dynamo.reset()
    params = {id(p) for p in model.parameters()} | {id(x)}
    saved_bytes = sum(t.numel() * t.element_size() for t in saved if id(t) not in params)
    return saved_bytes, out.detach(), x.grad


def test_budget_reaches_the_partitioner():
    full_bytes, full_out, full_grad = _saved_bytes_and_grads(1.0)
    low_bytes, low_out, low_grad = _saved_bytes_and_grads(0.05)
    assert low_bytes < full_bytes, (low_bytes, full_bytes)
    torch.testing.assert_close(low_out, full_out)
    torch.testing.assert_close(low_grad, full_grad)
