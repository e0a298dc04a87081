"""The Triton AdamW (trainer/triton_adamw.py) against torch's AdamW, in Triton's interpreter.

The kernel runs on a CPU under `TRITON_INTERPRET=1`, which must be set before the kernel is
first built, so the checks run in one fresh process (one start, not one per check). Reference: `torch.optim.AdamW` (for-loop,
fp32) given the same gradients divided by the clip factor. Tolerance: each parameter within 1e-6
of its tensor's largest element (8 fp32 units in the last place there) and each moment within
1e-5, so a missing or wrong term fails (weight decay at lr 1e-2 moves a parameter by 1e-3 of
itself; a bias correction changes the first update tenfold; a clip factor left out scales the
moments), while fp32 rounding of two orderings of one formula (lerp against multiply-add, a
division in the kernel against one before it) passes.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# requirements.txt installs triton where it has wheels (Linux); elsewhere there is nothing to run.
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="triton has Linux wheels only")

_PRELUDE = textwrap.dedent("""
    import torch
    from trainer.triton_adamw import BLOCK, TritonAdamW

    HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    SHAPES = [(3, 5), (BLOCK + 7,), (0,), (2, BLOCK)]  # a partial last block, an empty shard, two full blocks

    def close(a, b, what, tolerance):
        if b.numel() == 0:
            return
        worst = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert worst < tolerance, f"{what}: {worst:.2e} of its largest element"

    def check(triton_opt, params, ref_opt, ref):
        for i, (p, r) in enumerate(zip(params, ref)):
            close(p.detach(), r.detach(), f"parameter {i}", 1e-6)
            for key in ("exp_avg", "exp_avg_sq"):
                close(triton_opt.state[p][key], ref_opt.state[r][key], f"{key} of parameter {i}", 1e-5)
            assert triton_opt.state[p]["step"].item() == ref_opt.state[r]["step"].item()

    def step_both(opt, params, ref_opt, ref, gradient=lambda p: torch.randn(p.shape)):
        # The same fresh gradients into both optimizers' parameters, one step each, compared.
        for p, r in zip(params, ref):
            p.grad = gradient(p)
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        check(opt, params, ref_opt, ref)
""")

_STEPS = _PRELUDE + textwrap.dedent("""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = TritonAdamW(params, **HP)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for step, (divisor, dtype) in enumerate([(1.0, torch.float32), (3.0, torch.float32), (2.0, torch.bfloat16)]):
        grads = [torch.randn(s).to(dtype) for s in SHAPES]
        held = {p: g for p, g in zip(params, grads)}
        opt.gradient_of = held.get  # gradients in their own dtype, as compact gradients hold them
        opt.grad_scale = torch.tensor(divisor)
        for r, g in zip(ref, grads):
            r.grad = g.float() / divisor
        opt.step()
        ref_opt.step()
        check(opt, params, ref_opt, ref)
""")

_RESUME = _PRELUDE + textwrap.dedent("""
    import copy
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for _ in range(2):
        for r in ref:
            r.grad = torch.randn(r.shape)
        ref_opt.step()
    # A checkpoint of torch's AdamW resumes into the Triton AdamW, and the next step agrees.
    params = [torch.nn.Parameter(r.detach().clone()) for r in ref]
    opt = TritonAdamW(params, **HP)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # a loaded state shares no tensor with the saved one
    step_both(opt, params, ref_opt, ref)
    assert set(opt.state_dict()["state"][0]) == set(ref_opt.state_dict()["state"][0])
""")

_LAYOUTS = _PRELUDE + textwrap.dedent("""
    import copy
    torch.manual_seed(0)
    # A transposed parameter, stepped with gradients laid out otherwise (contiguous), then resumed
    # from contiguous moments (what a checkpoint loads): the kernel walks all four at the same offsets.
    params = [torch.nn.Parameter(torch.randn(BLOCK + 7, 3).t()), torch.nn.Parameter(torch.randn(1, 6))]
    assert not params[0].is_contiguous()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = TritonAdamW(params, **HP)
    ref_opt = torch.optim.AdamW(ref, foreach=False, **HP)
    for _ in range(2):
        step_both(opt, params, ref_opt, ref)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in params]
    saved = copy.deepcopy(opt.state_dict())
    for s in saved["state"].values():
        s["exp_avg"], s["exp_avg_sq"] = s["exp_avg"].contiguous(), s["exp_avg_sq"].contiguous()
    opt = TritonAdamW(resumed, **HP)
    opt.load_state_dict(saved)
    step_both(opt, resumed, ref_opt, ref, lambda p: torch.randn(p.shape).t().contiguous().t() if p.dim() == 2
              else torch.randn(p.shape))
    # A sliced view does not fill its memory: refused when the optimizer is built, not mid-run.
    try:
        TritonAdamW([torch.nn.Parameter(torch.randn(4, 6)[:, :3])], **HP)
    except ValueError as e:
        assert "optimizer.implementation = 'fused'" in str(e)
    else:
        raise AssertionError("a sliced parameter was accepted")
""")

_COMPACT_OVERLAPPED = textwrap.dedent("""
    import torch
    from parallel.data_parallel import compact_gradients
    from tests.test_overlapped_step import STEPS, VOCAB, _model, _units
    from trainer.config import Optimizer
    from trainer.optim import build_optimizer, clip_and_step
    from trainer.overlapped_step import OverlappedStep

    def train(implementation, overlap, steps=STEPS, copies=False):
        model = _model(compiled=False)  # fp32 parameters cast to bf16 at use
        compact = compact_gradients(model, torch.bfloat16, keep_copies=copies)
        cfg = Optimizer(lr=1e-2, implementation=implementation)
        optimizer = build_optimizer(model, cfg, torch.device("cpu"), compact)
        overlapped = OverlappedStep(optimizer, _units(model), torch.device("cpu"), compact.release) if overlap else None
        data = torch.Generator().manual_seed(1)
        norms = []
        for _ in range(steps):
            tokens = torch.randint(0, VOCAB, (2, 33), generator=data)
            compact.refresh_copies()
            logits = model(tokens[:, :-1])
            if overlapped is not None:
                overlapped.finish()
                assert not compact.gradients(), "every unit's forward released its compact gradients"
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            norms.append(clip_and_step(optimizer, model.parameters(), 0.05, compact, overlapped).item())
            if overlapped is None:
                assert not compact.gradients(), "the step released the compact gradients"
                optimizer.zero_grad(set_to_none=True)  # as the trainer does
        if overlapped is not None:
            overlapped.finish()
        if copies:
            # The kernel wrote each copy in its step and torch counted no write, so nothing was
            # cast again: every copy is its parameter rounded to bf16 as `Tensor.to` rounds.
            assert all(torch.equal(compact.copy_of(p), p.to(torch.bfloat16)) for p in compact.parameters)
            stale = [p for p in compact.parameters if compact._copied_versions[p] != p._version]
            assert not stale, "the Triton AdamW's writes are not counted, so the copies must be its own"
        return [p.detach().clone() for p in model.parameters()], norms

    # Unit by unit is the same kernel on the same values as all at once: bit for bit.
    after_backward, after_backward_norms = train("triton", overlap=False)
    params, norms = train("triton", overlap=True)
    assert min(norms) > 0.05, "clipping must be active for the test to cover it"
    assert norms == after_backward_norms
    assert all(torch.equal(got, want) for got, want in zip(params, after_backward))
    # Forward reading the copies the kernel writes trains bit for bit as casting at use.
    params, norms = train("triton", overlap=True, copies=True)
    assert norms == after_backward_norms
    assert all(torch.equal(got, want) for got, want in zip(params, after_backward))
    # Reading bf16 gradients is widening them first: one step from the same start agrees with
    # the for-loop AdamW on the widened gradients to fp32 rounding (later steps cast parameters
    # that differ by that rounding to bf16, which can round the other way).
    reference, _ = train("for-loop", overlap=False, steps=1)
    params, _ = train("triton", overlap=True, steps=1)
    for i, (got, want) in enumerate(zip(params, reference)):
        worst = ((got - want).abs().max() / want.abs().max()).item()
        assert worst < 1e-6, f"parameter {i}: {worst:.2e} of its largest element"
""")


_STATE_DICT_BEFORE_A_STEP = textwrap.dedent("""
    import torch
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    from parallel.data_parallel import compact_gradients
    from tests.test_overlapped_step import _model
    from trainer.config import Optimizer
    from trainer.optim import build_optimizer

    model = _model(compiled=False)
    compact = compact_gradients(model, torch.bfloat16)
    optimizer = build_optimizer(model, Optimizer(implementation="triton"), torch.device("cpu"), compact)
    # What a checkpoint save or a resume does before the first step: torch creates the state
    # by stepping zero gradients it puts in `.grad` (at lr 0).
    state = get_optimizer_state_dict(model, optimizer)["state"]
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert sorted(state) == sorted(names), (len(state), len(names))
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq"} for s in state.values())
""")


_COPIES_RESUME = textwrap.dedent("""
    import copy
    import torch
    from parallel.data_parallel import compact_gradients
    from parallel.parameter_views import stored_parameters
    from tests.test_overlapped_step import VOCAB, _model
    from trainer.config import Optimizer
    from trainer.optim import build_optimizer, clip_and_step

    BATCHES = [torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1)) for _ in range(4)]

    def build():
        model = _model(compiled=False)
        compact = compact_gradients(model, torch.bfloat16, keep_copies=True)
        return model, compact, build_optimizer(model, Optimizer(lr=1e-2, implementation="triton"),
                                               torch.device("cpu"), compact)

    def train(model, compact, optimizer, batches):
        for tokens in batches:
            compact.refresh_copies()  # as the trainer does before each forward
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            clip_and_step(optimizer, model.parameters(), 0.05, compact)
            optimizer.zero_grad(set_to_none=True)  # as the trainer does

    straight = build()
    train(*straight, BATCHES)
    first = build()
    train(*first, BATCHES[:2])
    saved = copy.deepcopy((first[0].state_dict(), first[2].state_dict()))
    # A resumed run: built, a forward's refresh before the load (its copies then hold the fresh
    # weights), then the checkpoint loaded in place. The Triton AdamW's own writes are not
    # counted; the load's are, so the next refresh casts the loaded weights.
    model, compact, optimizer = build()
    with torch.no_grad(), stored_parameters():
        for p in model.parameters():
            p.mul_(0.5)  # unlike the checkpoint: a copy left stale would show
    compact.refresh_copies()
    model.load_state_dict(saved[0])
    optimizer.load_state_dict(saved[1])
    train(model, compact, optimizer, BATCHES[2:])
    for (name, got), want in zip(model.named_parameters(), straight[0].parameters()):
        assert torch.equal(got, want), name
""")


_CHECKS = {
    "steps": _STEPS,
    "resume": _RESUME,
    "layouts": _LAYOUTS,
    "state_dict_before_a_step": _STATE_DICT_BEFORE_A_STEP,
    "compact_overlapped": _COMPACT_OVERLAPPED,
    "copies_resume": _COPIES_RESUME,
}

_DRIVER = textwrap.dedent("""
    import json, os, sys, traceback
    os.environ["TRITON_INTERPRET"] = "1"
    results = {}
    for name, body in json.loads(sys.stdin.read()).items():
        try:
            exec(compile(body, name, "exec"), {"__name__": name})
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Each check's outcome: "ok", or its traceback."""
    result = subprocess.run([sys.executable, "-c", _DRIVER], input=json.dumps(_CHECKS), capture_output=True,
                            text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_steps_match_torch_adamw_with_clip_factor_and_bf16_gradients(interpreted):
    assert interpreted["steps"] == "ok", interpreted["steps"]


def test_resumes_from_torch_adamw_state(interpreted):
    assert interpreted["resume"] == "ok", interpreted["resume"]


def test_transposed_parameters_and_gradients_of_another_layout(interpreted):
    assert interpreted["layouts"] == "ok", interpreted["layouts"]


def test_optimizer_state_is_created_for_a_checkpoint_before_the_first_step(interpreted):
    assert interpreted["state_dict_before_a_step"] == "ok", interpreted["state_dict_before_a_step"]


def test_compact_gradients_read_in_bf16_step_unit_by_unit_like_widened_ones(interpreted):
    """The trainer's wiring: compact gradients, read by the Triton AdamW where they are held and
    released unit by unit by the overlapped step, train as after backward, and step as the
    for-loop AdamW does on the widened gradients."""
    assert interpreted["compact_overlapped"] == "ok", interpreted["compact_overlapped"]


def test_weight_copies_are_cast_again_after_a_checkpoint_load(interpreted):
    """Kept bf16 weight copies written by the Triton AdamW: a run resumed from a checkpoint of
    step 2 (loaded in place, after a forward had refreshed the copies) ends bit for bit where
    the run without a break does."""
    assert interpreted["copies_resume"] == "ok", interpreted["copies_resume"]


@pytest.mark.parametrize("overrides, expected", [
    (["--optimizer.implementation", "fused"], False),  # it widens compact gradients after backward: no overlap
    (["--optimizer.implementation", "triton"], True),
])
def test_compact_gradients_overlap_only_with_the_triton_adamw(tmp_path, overrides, expected):
    from trainer.config import load_config
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--comm.mode", "fake_backend",  # resolves as on a GPU
                       "--training.mixed_precision_param", "bfloat16", "--training.compact_gradients", "true",
                       *overrides])
    run = resolve_run(cfg, world_size=1)
    assert run.compact_gradients and run.overlap_step is expected


def test_triton_on_a_cpu_is_one_config_error(tmp_path):
    from trainer.config import load_config
    from trainer.errors import ConfigError
    from trainer.run import resolve_run

    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--optimizer.implementation", "triton"])
    with pytest.raises(ConfigError, match="optimizer.implementation = 'triton' runs on a GPU"):
        resolve_run(cfg, world_size=1)


@pytest.mark.parametrize("device_type, installed, expected", [
    ("cuda", True, "triton"),
    ("cuda", False, "fused"),
    ("cpu", True, "foreach"),
])
def test_auto_is_the_triton_adamw_on_cuda_where_triton_is_installed(monkeypatch, device_type, installed, expected):
    import trainer.optim
    from trainer.config import Optimizer

    monkeypatch.setattr(trainer.optim, "triton_available", lambda: installed)
    assert trainer.optim.optimizer_implementation(Optimizer(), device_type) == expected


def test_triton_without_triton_or_a_compiler_is_one_config_error(tmp_path, monkeypatch):
    import trainer.run
    from trainer.config import load_config
    from trainer.errors import ConfigError

    monkeypatch.setattr(trainer.run, "triton_available", lambda: False)
    cfg = load_config(["--job.config_file", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path),
                       "--comm.mode", "fake_backend", "--optimizer.implementation", "triton"])
    with pytest.raises(ConfigError, match="needs the triton package .* and a C compiler"):
        trainer.run.resolve_run(cfg, world_size=1)


def test_triton_is_not_available_without_a_c_compiler(monkeypatch):
    """Triton builds its kernel launcher with a C compiler at first use; without one, `auto`
    must pick torch's fused AdamW rather than fail at the first step."""
    import trainer.optim

    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(trainer.optim.shutil, "which", lambda name: None)
    assert not trainer.optim.triton_available()
    monkeypatch.setenv("CC", "/usr/bin/cc")
    assert trainer.optim.triton_available()
