"""Gradient norms taken unit by unit during backward (parallel/backward_grad_norms.py).

On a CPU the norms are taken in place, in the hook (there is no side stream), so these tests
check what the GPU path shares with it: each unit's norms are taken while backward still runs,
in backward's order, and only in the armed (last) micro-batch's backward; the total is bit for
bit `global_norm` after backward (fp32 gradients, and bf16 compact gradients beside fp32
ones; eager and per-block compiled); a gradient written again after its norm was taken is
normed again at the end. The trainer path (dp = 1 with the step overlapped, tensor parallel,
micro-batches) is checked by tests/test_training_resume.py.
"""

import pytest
import torch
from torch import nn

from tests.test_overlapped_step import VOCAB, _model, _units

FP32 = torch.float32


class _Recorder:
    """`fp64_norms`, recording for each call whether backward was running, the dtypes, and the
    unit (of `holders`) whose gradients it got."""

    def __init__(self, holders):
        self.holders = holders
        self.calls: list[tuple[bool, set, set]] = []
        self.in_backward = False

    def __call__(self, grads):
        from parallel.grad_clip import fp64_norms

        units = {i for i, unit in enumerate(self.holders) for h in unit for g in grads if h.grad is g}
        self.calls.append((self.in_backward, {g.dtype for g in grads}, units))
        return fp64_norms(grads)


def _holders(model, compact):
    from parallel.backward_grad_norms import unit_holders

    return unit_holders(_units(model), model.parameters(), compact.holder_of if compact is not None else (lambda p: p))


def _backward(model, recorder, generator, accum=1, norms=None):
    for index in range(accum):
        tokens = torch.randint(0, VOCAB, (2, 33), generator=generator).to(next(model.parameters()).device)
        if norms is not None and index == accum - 1:
            norms.arm()
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        recorder.in_backward = True
        (loss / accum).backward()
        recorder.in_backward = False


def _grads(model, compact):
    loose = [p.grad for p in model.parameters() if p.grad is not None]
    return loose + (compact.gradients() if compact is not None else [])


@pytest.mark.parametrize("compact, compiled", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "compact bf16", "compact bf16 compiled per block"])
def test_unit_norms_taken_in_backward_order_give_the_same_total(compact, compiled):
    from parallel.backward_grad_norms import BackwardGradNorms
    from parallel.data_parallel import compact_gradients
    from parallel.grad_clip import global_norm

    model = _model(compiled)
    held = compact_gradients(model, torch.bfloat16) if compact else None
    holders = _holders(model, held)
    recorder = _Recorder(holders)
    norms = BackwardGradNorms(holders, recorder, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):  # the second step re-arms over a model that has been through one
        _backward(model, recorder, generator, norms=norms)
        grads = _grads(model, held)
        assert torch.equal(global_norm(grads, norms.norms), global_norm(grads))
        norms.disarm()
        for p in model.parameters():
            p.grad = None
        if held is not None:
            held.release(held.parameters)

    assert all(in_backward for in_backward, _, _ in recorder.calls), "every norm was taken during backward"
    assert all(len(dtypes) == 1 and len(units) == 1 for _, dtypes, units in recorder.calls), "one unit and dtype a call"
    order = []  # backward's order: head (norm + output), blocks last to first, embedding
    for _, _, (unit,) in recorder.calls:
        if not order or order[-1] != unit:
            order.append(unit)
    assert order == 2 * list(reversed(range(len(holders))))
    if compact:
        assert {dtype for _, (dtype,), _ in recorder.calls} == {torch.bfloat16, FP32}


def test_only_the_armed_backward_takes_norms():
    from parallel.backward_grad_norms import BackwardGradNorms
    from parallel.grad_clip import global_norm

    model = _model(compiled=False)
    holders = _holders(model, None)
    recorder = _Recorder(holders)
    norms = BackwardGradNorms(holders, recorder, torch.device("cpu"))
    _backward(model, recorder, torch.Generator().manual_seed(1), accum=3, norms=norms)
    grads = _grads(model, None)
    assert len(recorder.calls) == len(holders), "one call a unit: the last micro-batch's backward only"
    assert torch.equal(global_norm(grads, norms.norms), global_norm(grads))
    assert len(recorder.calls) == len(holders), "none taken again after backward"


class _Reused(nn.Module):
    """`first` runs outside and inside a reentrant checkpoint, whose backward is a backward of
    its own: `first`'s gradient is accumulated once when backward leaves the outer use (its
    unit is then complete) and again inside the checkpoint's backward. (Within one backward
    autograd sums a leaf's uses before accumulating them once.)"""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        inner = lambda h: torch.tanh(self.second(self.first(h)))  # noqa: E731
        return self.first(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=True))


def test_a_gradient_written_after_its_norm_is_normed_again():
    from parallel.backward_grad_norms import BackwardGradNorms
    from parallel.grad_clip import global_norm

    torch.manual_seed(0)
    model = _Reused()
    holders = [list(model.first.parameters()), list(model.second.parameters())]
    recorder = _Recorder(holders)
    norms = BackwardGradNorms(holders, recorder, torch.device("cpu"))
    for _ in range(2):  # the second step accumulates onto the first's gradients
        norms.arm()
        loss = model(torch.randn(4, 8, requires_grad=True)).square().sum()
        recorder.in_backward = True
        loss.backward()
        recorder.in_backward = False
        grads = [p.grad for p in model.parameters()]
        assert torch.equal(global_norm(grads, norms.norms), global_norm(grads))
        norms.disarm()
    late = [units for in_backward, _, units in recorder.calls if not in_backward]
    assert late == [{0}, {0}], "first's weight and bias normed again after backward, in each step"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream needs a GPU")
def test_on_a_gpu_side_stream_norms_are_bitwise_global_norm():
    """On CUDA: `torch._foreach_norm` gives a tensor the same norm in any list (many tensors,
    several chunks each, several launches), and the norms taken on the side stream during
    backward give `global_norm`'s total to the bit."""
    from parallel.backward_grad_norms import BackwardGradNorms
    from parallel.data_parallel import compact_gradients
    from parallel.grad_clip import fp64_norms, global_norm

    generator = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=generator)
               for n in [3 * 2**22 + 5, 3072, 2**20] * 20]
    together = fp64_norms(tensors)
    apart = [norm for i in range(0, len(tensors), 7) for norm in fp64_norms(tensors[i:i + 7])]
    assert all(torch.equal(a, b) for a, b in zip(together, apart))

    model = _model(compiled=False).cuda()
    held = compact_gradients(model, torch.bfloat16)
    holders = _holders(model, held)
    norms = BackwardGradNorms(holders, fp64_norms, torch.device("cuda"))
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        _backward(model, _Recorder(holders), generator, norms=norms)
        grads = _grads(model, held)
        assert torch.equal(global_norm(grads, norms.norms), global_norm(grads))
        norms.disarm()
        held.release(held.parameters)


def _train_with_backward_norms(rank, world_size, dump, corpus, backward_norms):
    import dataclasses

    from tests.test_training_resume import RESUME
    from trainer.config import load_config
    from trainer.run import resolve_run
    from trainer.trainer import Trainer

    cfg = load_config(RESUME + ["--training.dataset_path", corpus, "--training.steps", "3",
                                "--optimizer.overlap_step", "off", "--job.dump_folder", dump])
    run = resolve_run(cfg, world_size)
    assert not run.backward_grad_norms  # a CPU run: auto leaves them after backward
    trainer = Trainer(dataclasses.replace(run, backward_grad_norms=backward_norms))
    assert (trainer.backward_norms is not None) is backward_norms
    trainer.train()
    trainer.close()


def test_trainer_with_the_step_after_backward_gets_the_same_norms_from_backward(tmp_path, corpus):
    """On a GPU at dp = 1 the norms are taken during backward also when the step runs after
    it (trainer/run.py `_backward_grad_norms`); on a CPU that path is forced here: the losses
    and gradient norms of 3 steps equal, bit for bit, those of norms taken after backward."""
    import json

    from tests.dist_utils import run_distributed

    records = {}
    for backward_norms in (False, True):
        dump = str(tmp_path / str(backward_norms))
        run_distributed(_train_with_backward_norms, 1, dump, corpus, backward_norms)
        with open(f"{dump}/metrics.jsonl") as f:
            records[backward_norms] = [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f)]
    assert [step for step, _, _ in records[True]] == [1, 2, 3]
    assert records[True] == records[False]


@pytest.mark.parametrize("overrides, world, expected", [
    ([], 1, False),  # a CPU run
    (["--comm.mode", "fake_backend", "--parallelism.tensor_parallel_degree", "4", "--optimizer.overlap_step", "off"],
     4, True),  # a GPU plan at dp = 1, step after backward
    (["--comm.mode", "fake_backend", "--parallelism.tensor_parallel_degree", "2"], 4, False),  # dp = 2
    (["--comm.mode", "fake_backend", "--parallelism.tensor_parallel_degree", "4", "--compile.enable",
      "--compile.strategy", "model"], 4, False),  # one graph hands over every gradient at its end
    (["--optimizer.overlap_step", "on"], 1, True),  # the overlapped step needs them
])
def test_backward_norms_resolve_where_autograd_makes_each_gradient_on_a_gpu(tmp_path, overrides, world, expected):
    from trainer.config import load_config
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       *overrides])
    assert resolve_run(cfg, world_size=world).backward_grad_norms is expected
