"""Compile health on small functions compiled with the "eager" backend (no codegen, fast)."""

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from trainer.compile_health import CompileHealth, RecompileBudgetExceeded
from trainer.config import Compile


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch.compiler.set_stance("default")
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def make_health(tmp_path):
    made = []

    def make(rank=0, **cfg):
        health = CompileHealth(Compile(**cfg), dump_folder=str(tmp_path), rank=rank)
        made.append(health)
        return health

    yield make
    for health in made:
        health.close()


def scaled_sum(x):
    return (x * 2).sin().sum()


def run_steps(health, fn, inputs, first_step=1):
    for step, x in enumerate(inputs, start=first_step):
        fn(x)
        health.check(step)
    return first_step + len(inputs) - 1


def test_steady_state_has_no_recompiles(make_health):
    health = make_health(warmup_steps=2)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    last = run_steps(health, fn, [torch.randn(4) for _ in range(5)])
    snap = health.snapshot(last)
    assert health.warm
    assert snap["recompiles"] == 0
    assert snap["recompiles_after_warmup"] == 0
    assert snap["graph_breaks"] == 0
    assert snap["unique_graphs"] == 1
    assert snap["compile_time_s"] > 0
    assert snap["compile_time_first_s"] == snap["compile_time_s"]
    assert health.events == []


def test_shape_change_after_warmup_is_a_recompile_with_its_reason(make_health):
    health = make_health(warmup_steps=2)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    last = run_steps(health, fn, [torch.randn(4)] * 3)
    assert health.snapshot(last)["recompiles"] == 0
    fn(torch.randn(7))
    health.check(last + 1)
    snap = health.snapshot(last + 1)
    assert snap["recompiles"] == 1
    assert snap["recompiles_since_log"] == 1
    assert snap["recompiles_after_warmup"] == 1
    assert snap["compile_time_s"] > snap["compile_time_first_s"]
    (event,) = [e for e in health.events if e.kind == "recompile"]
    assert "size mismatch" in event.summary and "expected 4, actual 7" in event.summary
    assert "scaled_sum" in event.where
    assert event.step == last + 1 and event.after_warmup
    assert health.snapshot(last + 2)["recompiles_since_log"] == 0


def test_grad_mode_change_is_a_recompile_with_its_reason(make_health):
    health = make_health(warmup_steps=1)
    fn = torch.compile(scaled_sum, backend="eager")
    run_steps(health, fn, [torch.randn(4)] * 2)
    with torch.no_grad():
        fn(torch.randn(4))
    health.check(3)
    assert health.recompiles_after_warmup == 1
    assert "grad_mode" in health.events[-1].summary


def with_breaks(x):
    y = x * 2
    print("graph break: print")
    y = y + 1
    torch._dynamo.graph_break()
    return y.sum()


def test_graph_breaks_are_counted_with_reasons_and_logged_once(make_health, caplog):
    health = make_health(warmup_steps=1)
    fn = torch.compile(with_breaks, backend="eager", dynamic=False)
    with caplog.at_level(logging.WARNING, logger="trainer.compile_health"):
        run_steps(health, fn, [torch.randn(3)] * 3)
        snap = health.snapshot(3)
        assert snap["graph_breaks"] == 2
        assert snap["unique_graphs"] == 3
        summaries = [e.summary for e in health.events if e.kind == "graph_break"]
        assert len(summaries) == 2
        assert any("print" in s for s in summaries)
        assert any("graph_break()" in s for s in summaries)
        assert all(__file__ in e.where for e in health.events)
        # A recompile retraces the same two breaks: counted again, reported once.
        fn(torch.randn(5))
        health.check(4)
    assert health.snapshot(4)["graph_breaks"] > 2
    assert len([e for e in health.events if e.kind == "graph_break"]) == 2
    assert sum("graph break" in r.getMessage() and "print" in r.getMessage() for r in caplog.records) == 1


def loop_with_break(x):
    for _ in range(2):
        x = x + 1
        torch._dynamo.graph_break()
    return x


def test_frame_that_falls_back_to_eager_counts_as_a_graph_break(make_health):
    health = make_health()
    fn = torch.compile(loop_with_break, backend="eager")
    fn(torch.randn(3))
    snap = health.snapshot(1)
    assert counters["graph_break"] == {}  # Dynamo's own graph_break counter misses it
    assert snap["graph_breaks"] == 1
    (event,) = health.events
    assert "runs eagerly" in event.summary


def add_one(x):
    return x + 1


def test_recompile_limit_fallback_counts_as_graph_break_with_reason(make_health):
    health = make_health(warmup_steps=0)
    fn = torch.compile(add_one, backend="eager", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        fn(torch.randn(2))
        fn(torch.randn(3))
    health.check(1)
    assert health.recompiles == 1
    assert health.graph_breaks == 1
    breaks = [e for e in health.events if e.kind == "graph_break"]
    assert "recompile limit" in breaks[0].summary and "add_one" in breaks[0].where


def test_budget_raises_with_the_reasons(make_health):
    health = make_health(warmup_steps=2, max_recompiles_after_warmup=1)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    last = run_steps(health, fn, [torch.randn(4)] * 2)
    last = run_steps(health, fn, [torch.randn(5)], first_step=last + 1)  # 1 recompile: within budget
    fn(torch.randn(6))
    with pytest.raises(RecompileBudgetExceeded) as err:
        health.check(last + 1)
    message = str(err.value)
    assert "compile.max_recompiles_after_warmup=1" in message
    assert "expected 4, actual 5" in message and "expected 5, actual 6" in message


def test_recompiles_during_warmup_do_not_count_against_the_budget(make_health):
    health = make_health(warmup_steps=3, max_recompiles_after_warmup=0)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    run_steps(health, fn, [torch.randn(n) for n in (2, 3, 4)] + [torch.randn(4)] * 2)
    assert health.recompiles == 2
    assert health.recompiles_after_warmup == 0


def test_fail_on_recompile_stance_after_warmup_and_allowed_recompiles(make_health):
    health = make_health(warmup_steps=1, fail_on_recompile=True, max_recompiles_after_warmup=0)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    run_steps(health, fn, [torch.randn(4)])
    assert health.warm
    with health.allow_recompiles("validation"):
        with torch.no_grad():
            fn(torch.randn(4))
    health.check(2)  # the allowed recompile does not count against the budget
    assert (health.recompiles, health.recompiles_after_warmup) == (1, 0)
    assert health.events[-1].allowed == "validation"
    with pytest.raises(RuntimeError, match="fail_on_recompile"):
        fn(torch.randn(9))
    health.close()
    fn(torch.randn(9))  # close() lifted the stance


def test_report_lists_recompiles_and_graph_breaks(make_health, tmp_path):
    health = make_health(warmup_steps=1)
    fn = torch.compile(with_breaks, backend="eager", dynamic=False)
    run_steps(health, fn, [torch.randn(3), torch.randn(4)])
    path = health.write_report()
    text = open(path).read()
    assert path == str(tmp_path / "compile_report.txt")
    assert "recompiles: 3" in text  # the function and its two resume functions
    assert "== Graph breaks (2 distinct) ==" in text
    assert "size mismatch" in text and "print" in text


def test_other_ranks_track_but_neither_log_nor_write(make_health, tmp_path, caplog):
    health = make_health(rank=1, warmup_steps=0, max_recompiles_after_warmup=0)
    fn = torch.compile(with_breaks, backend="eager", dynamic=False)
    with caplog.at_level(logging.WARNING, logger="trainer.compile_health"):
        fn(torch.randn(3))
        health.check(1)
        fn(torch.randn(4))
        with pytest.raises(RecompileBudgetExceeded):
            health.check(2)
    assert health.write_report() is None
    assert not any(r.name == "trainer.compile_health" for r in caplog.records)
    assert list(tmp_path.iterdir()) == []


def test_close_restores_dynamo_loggers(make_health):
    loggers = [logging.getLogger(n) for n in logging.root.manager.loggerDict if n.endswith(".__graph_breaks")]
    assert loggers
    before = [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    health = make_health()
    assert all(lg.isEnabledFor(logging.DEBUG) for lg in loggers)
    health.close()
    assert [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers] == before


def test_compiled_module_is_named_as_such(make_health):
    health = make_health(warmup_steps=1)
    module = torch.compile(torch.nn.Linear(3, 2), backend="eager", dynamic=False)
    run_steps(health, module, [torch.randn(2, 3), torch.randn(5, 3)])
    (event,) = health.events
    assert event.where.startswith("a torch.compile'd module")
    assert "size mismatch" in event.summary


def test_a_resumed_run_warms_up_again(make_health):
    health = make_health(warmup_steps=2, max_recompiles_after_warmup=0)
    fn = torch.compile(scaled_sum, backend="eager", dynamic=False)
    run_steps(health, fn, [torch.randn(4), torch.randn(5)], first_step=101)  # resumed at step 100
    assert health.warm
    assert (health.recompiles, health.recompiles_after_warmup) == (1, 0)
