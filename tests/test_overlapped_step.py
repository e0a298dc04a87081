"""The optimizer step unit by unit, finished by the next forward (trainer/overlapped_step.py).

On a CPU the units step in place (there is no stream to overlap with), so these tests check
what the GPU path shares with it: the update is bit for bit the plain `optimizer.step()`
(foreach, and fused with the clip folded in; eager and per-block compiled, where the wait runs
as a hook outside each block's graph), each unit's gradients are released exactly when its
forward begins, and `optimizer.overlap_step` resolves or fails with one line. The trainer path
(gradient accumulation, a save right after an overlapped step, a resume into one, tensor
parallel) is checked by tests/test_training_resume.py.
"""

import pytest
import torch

STEPS = 3
VOCAB = 512


def _model(compiled: bool):
    from models.llama3.args import flavor_args
    from models.llama3.model import Transformer
    from parallel.data_parallel import apply_compute_dtype
    from parallel.init import sharded_init_normal_
    from parallel.parameter_views import stored_parameters

    args = flavor_args("tinymodel", vocab_size=VOCAB, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(args)
    if compiled:
        for block in model.layers.values():
            block.compile(backend="aot_eager", fullgraph=True, dynamic=False)
    apply_compute_dtype(model, torch.bfloat16)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with stored_parameters():
        model.init_weights(sharded_init_normal_)
    return model


def _units(model):
    from models.llama3.parallelize import fsdp_units

    return fsdp_units(model)


def _train(overlap: bool, fused: bool, compiled: bool, released: list | None = None):
    from trainer.optim import clip_and_step
    from trainer.overlapped_step import OverlappedStep

    model = _model(compiled)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    overlapped = OverlappedStep(optimizer, _units(model), torch.device("cpu")) if overlap else None
    if released is not None:
        units = _units(model)
        unit_params = [[p for m in (u if isinstance(u, list) else [u]) for p in m.parameters()] for u in units]

        def probe(index):
            def hook(module, args):  # runs after the step's own hook: which units still hold gradients
                released.append((index, [all(p.grad is None for p in params) for params in unit_params]))
            return hook

        for index, unit in enumerate(units):
            (unit[0] if isinstance(unit, list) else unit).register_forward_pre_hook(probe(index))
    data = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 33), generator=data)
        logits = model(tokens[:, :-1])
        if overlapped is not None:
            overlapped.finish()
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        norms.append(clip_and_step(optimizer, model.parameters(), max_norm=0.05, overlapped=overlapped).item())
        if overlapped is None:
            optimizer.zero_grad(set_to_none=True)
    if overlapped is not None:
        overlapped.finish()
    return [p.detach().clone() for p in model.parameters()], norms


@pytest.mark.parametrize("fused, compiled", [(False, False), (True, False), (True, True)],
                         ids=["foreach", "fused", "fused-compiled-blocks"])
def test_unit_by_unit_step_is_bitwise_the_plain_step(fused, compiled):
    reference, reference_norms = _train(False, fused, compiled)
    params, norms = _train(True, fused, compiled)
    assert min(norms) > 0.05, "clipping must be active for the test to cover it"
    assert norms == reference_norms
    for got, want in zip(params, reference):
        assert torch.equal(got, want)


def test_each_unit_releases_its_gradients_when_its_forward_begins():
    released = []
    _train(True, fused=False, compiled=False, released=released)
    n_units = len(_units(_model(False)))
    # The first forward has no step before it: nothing is held, so every unit reads "released".
    first, later = released[:n_units], released[n_units:]
    assert all(all(flags) for _, flags in first)
    assert len(later) == (STEPS - 1) * n_units
    for index, flags in later:
        assert flags == [unit <= index for unit in range(n_units)], (index, flags)


@pytest.mark.parametrize("overrides, world, needle", [
    (["--optimizer.overlap_step", "on"], 2, "does not work with data parallel degree 2 > 1"),
    (["--optimizer.overlap_step", "on", "--compile.enable", "--compile.strategy", "model"], 1,
     "does not work with compile.strategy = 'model'"),
    (["--optimizer.overlap_step", "on", "--training.mixed_precision_param", "bfloat16",
      "--training.compact_gradients", "true"], 1, "does not work with training.compact_gradients = true"),
])
def test_on_where_it_cannot_apply_is_one_config_error(tmp_path, overrides, world, needle):
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       *overrides])
    with pytest.raises(ConfigError, match=needle) as error:
        resolve_run(cfg, world_size=world)
    assert "set optimizer.overlap_step = 'auto' or 'off'" in str(error.value)


@pytest.mark.parametrize("overrides, world, expected", [
    ([], 1, False),  # auto on a CPU: nothing to overlap with
    (["--optimizer.overlap_step", "on"], 1, True),
    (["--comm.mode", "fake_backend"], 8, False),  # auto, dp = 8
    (["--comm.mode", "fake_backend", "--parallelism.tensor_parallel_degree", "4"], 4, True),  # a GPU plan, dp = 1
    (["--comm.mode", "fake_backend", "--parallelism.tensor_parallel_degree", "4", "--optimizer.overlap_step", "off"],
     4, False),
])
def test_auto_turns_on_where_it_applies_on_a_gpu(tmp_path, overrides, world, expected):
    from trainer.config import load_config
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       *overrides])
    assert resolve_run(cfg, world_size=world).overlap_step is expected
