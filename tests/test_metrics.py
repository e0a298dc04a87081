"""MetricsLogger: records, sinks, rank gating, throughput/MFU math and console format."""

import io
import json
import math

import pytest
import torch
import torch._dynamo
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer import metrics
from trainer.compile_health import CompileHealth
from trainer.config import Compile, Metrics
from trainer.metrics import MetricsLogger, device_peak_flops, format_console, format_eta, peak_flops_for_name


class FakeClock:
    """Stands in for the `time` module inside trainer.metrics so durations are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(metrics, "time", fake)
    return fake


def make_logger(tmp_path, rank=0, log_freq=2, total_steps=5, **kwargs):
    kwargs.setdefault("stream", io.StringIO())
    return MetricsLogger(
        Metrics(log_freq=log_freq),
        dump_folder=str(tmp_path),
        rank=rank,
        device=torch.device("cpu"),
        flops_per_token=kwargs.pop("flops_per_token", 6e6),
        total_steps=total_steps,
        **kwargs,
    )


def run(logger, clock, steps, tokens_per_step=1000, step_seconds=1.0, data_seconds=0.25):
    records = []
    for step in range(1, steps + 1):
        logger.step_begin()
        clock.now += data_seconds
        logger.data_loaded()
        clock.now += step_seconds - data_seconds
        if logger.should_log(step):
            since = step - (records[-1]["step"] if records else 0)
            grad_norm = float("nan") if step == 4 else 0.5 * step
            window = logger.end_window(step, tokens=tokens_per_step * since)
            records.append(logger.log(window, loss=10.0 / step, grad_norm=grad_norm, lr=1e-3))
    return records


def test_should_log_every_log_freq_and_the_last_step(tmp_path):
    logger = make_logger(tmp_path, log_freq=10, total_steps=25, peak_flops=1.0)
    assert [s for s in range(1, 26) if logger.should_log(s)] == [10, 20, 25]
    logger.close()


def test_throughput_mfu_and_timing_math(tmp_path, clock):
    # 2 steps of 1 s, 1000 tokens each, 6e6 FLOP/token, fake peak 1e10 FLOP/s.
    logger = make_logger(tmp_path, total_steps=10, peak_flops=1e10)
    (record,) = run(logger, clock, steps=2)
    assert record["tps"] == pytest.approx(1000.0)
    assert record["tflops"] == pytest.approx(1000.0 * 6e6 / 1e12)
    assert record["mfu"] == pytest.approx(100.0 * 1000.0 * 6e6 / 1e10)
    assert record["step_time_s"] == pytest.approx(1.0)
    assert record["data_time_pct"] == pytest.approx(25.0)
    assert record["eta_s"] == pytest.approx(8.0)
    logger.close()


def test_window_runs_from_log_to_log_without_excluded_time(tmp_path, clock):
    logger = make_logger(tmp_path, total_steps=4, peak_flops=1e10)
    clock.now += 100.0  # before the first step (start-up): not part of the first window
    logger.step_begin()
    clock.now += 1.0
    logger.step_begin()
    clock.now += 1.0
    first = logger.log(logger.end_window(2, tokens=2000), loss=1.0, grad_norm=1.0, lr=1.0)
    with logger.excluded():
        clock.now += 30.0  # e.g. a checkpoint save between steps: not part of the next window
    clock.now += 2.0  # host work between the log and the next step does count
    for _ in range(2):
        logger.step_begin()
        clock.now += 3.0
    record = logger.log(logger.end_window(4, tokens=2000), loss=1.0, grad_norm=1.0, lr=1.0)
    assert first["step_time_s"] == pytest.approx(1.0)
    assert record["step_time_s"] == pytest.approx(4.0)
    assert record["tps"] == pytest.approx(250.0)
    assert record["data_time_pct"] == 0.0
    logger.close()


def test_a_window_logged_a_step_late_keeps_its_own_steps_and_data_time(tmp_path, clock):
    """The trainer closes a window at its last step and logs it once the device has run that
    step, after the next step has begun: the next step's data time belongs to the next window,
    and the time runs to the log, when the device finished the window's steps."""
    logger = make_logger(tmp_path, log_freq=1, total_steps=3, peak_flops=1e10)
    windows, records = [], []
    for step in range(1, 4):
        logger.step_begin()
        clock.now += 0.1 * step  # data: 0.1, 0.2, 0.3 s
        logger.data_loaded()
        clock.now += 0.5  # the host launches the step, which the device runs later
        if windows:
            clock.now += 0.4  # waits for the previous step to finish on the device
            records.append(logger.log(windows.pop(), loss=1.0, grad_norm=1.0, lr=1.0))
        windows.append(logger.end_window(step, tokens=100))
    clock.now += 1.0
    records.append(logger.log(windows.pop(), loss=1.0, grad_norm=1.0, lr=1.0))
    assert [r["step"] for r in records] == [1, 2, 3]
    # step 1's window: its begin (t=0) to its log (t=0.1+0.5+0.2+0.5+0.4 = 1.7)
    assert records[0]["step_time_s"] == pytest.approx(1.7)
    assert records[0]["data_time_pct"] == pytest.approx(100 * 0.1 / 1.7)
    assert records[1]["step_time_s"] == pytest.approx(0.3 + 0.5 + 0.4)
    assert records[1]["data_time_pct"] == pytest.approx(100 * 0.2 / 1.2)
    assert records[2]["step_time_s"] == pytest.approx(1.0)
    assert records[2]["data_time_pct"] == pytest.approx(100 * 0.3 / 1.0)
    logger.close()


def test_jsonl_and_tensorboard_records(tmp_path, clock):
    logger = make_logger(tmp_path, peak_flops=1e10)
    records = run(logger, clock, steps=5)
    logger.log_scalars(5, {"validation/loss": 2.5, "validation/perplexity": math.exp(2.5)})
    logger.close()

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 5, 5]
    assert rows[1]["grad_norm"] is None  # NaN is written as null
    assert rows[0]["loss"] == pytest.approx(5.0)
    assert rows[2]["tps"] == pytest.approx(records[2]["tps"])
    expected_keys = {
        "step", "loss", "grad_norm", "lr", "tps", "tflops", "mfu", "step_time_s", "data_time_pct",
        "memory_max_active_gib", "memory_max_reserved_gib", "memory_pct", "eta_s",
    }  # fmt: skip
    assert set(rows[0]) == expected_keys
    assert rows[0]["memory_max_active_gib"] > 0  # CPU: process max RSS
    assert rows[0]["memory_max_reserved_gib"] is None and rows[0]["memory_pct"] is None
    assert rows[3] == {"step": 5, "validation/loss": 2.5, "validation/perplexity": pytest.approx(math.exp(2.5))}

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    loss = events.Scalars("loss/loss")
    assert [e.step for e in loss] == [2, 4, 5]
    assert [e.value for e in loss] == pytest.approx([5.0, 2.5, 2.0])
    assert [e.value for e in events.Scalars("throughput/mfu")] == pytest.approx([r["mfu"] for r in records])
    assert events.Scalars("validation/loss")[0].value == pytest.approx(2.5)
    assert "memory/memory_pct" not in events.Tags()["scalars"]  # None values are skipped


def test_extra_scalars_join_the_record(tmp_path, clock):
    stream = io.StringIO()
    logger = make_logger(tmp_path, total_steps=2, peak_flops=None, stream=stream)
    logger.step_begin()
    clock.now += 1.0
    record = logger.log(logger.end_window(2, tokens=10), loss=1.0, grad_norm=1.0, lr=1.0, extra={"val_loss": 3.25})
    logger.close()
    assert record["val_loss"] == 3.25
    assert record["mfu"] is None  # CPU: no peak
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["val_loss"] == 3.25
    assert "val_loss 3.25" in stream.getvalue()


def test_other_ranks_write_nothing(tmp_path, clock):
    stream = io.StringIO()
    folder = tmp_path / "run"
    logger = make_logger(folder, rank=1, peak_flops=1e10, stream=stream)
    records = run(logger, clock, steps=5)
    logger.log_scalars(5, {"validation/loss": 1.0})
    logger.close()
    assert len(records) == 3  # the record is still computed and returned
    assert not folder.exists()
    assert stream.getvalue() == ""


def test_compile_health_fields_are_merged(tmp_path, clock):
    torch._dynamo.reset()
    health = CompileHealth(Compile(), dump_folder=str(tmp_path), rank=0)
    stream = io.StringIO()
    logger = make_logger(tmp_path, total_steps=2, peak_flops=1e10, compile_health=health, stream=stream)
    fn = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    fn(torch.randn(2))
    fn(torch.randn(3))
    logger.step_begin()
    record = logger.log(logger.end_window(2, tokens=10), loss=1.0, grad_norm=1.0, lr=1.0)
    logger.close()
    health.close()
    torch._dynamo.reset()
    assert record["recompiles"] == 1 and record["recompiles_since_log"] == 1
    assert {"graph_breaks", "unique_graphs", "compile_time_s", "compile_time_first_s"} <= set(record)
    assert "recompiles 1 (+1)" in stream.getvalue()


def test_console_line_format():
    record = {
        "step": 7, "loss": 2.34567, "grad_norm": 1.5, "lr": 3e-4, "tps": 12345.6, "tflops": 98.76, "mfu": 9.98,
        "memory_max_active_gib": 30.5, "memory_pct": 45.2, "recompiles": 3, "recompiles_since_log": 0, "eta_s": 3725,
    }  # fmt: skip
    line = format_console(record, 1000, color=False)
    assert line == (
        "step    7/1000  loss 2.3457  gnorm 1.5  lr 3.00e-04  tps 12,346  tflops 98.8  mfu 10.0%"
        "  mem 30.50GiB (45%)  recompiles 3  eta 1h02m"
    )
    colored = format_console({**record, "recompiles_since_log": 2}, 1000, color=True)
    assert "\033[" in colored and "recompiles 3 (+2)" in colored
    cpu_line = format_console({**record, "mfu": None, "memory_pct": None}, 1000, color=False)
    assert "mfu" not in cpu_line and "mem 30.50GiB  " in cpu_line


@pytest.mark.parametrize(
    "seconds, text",
    [(0, "0s"), (42.4, "42s"), (307, "5m07s"), (3725, "1h02m"), (2 * 86400 + 3 * 3600 + 5, "2d03h"), (None, "?")],
)
def test_format_eta(seconds, text):
    assert format_eta(seconds) == text


@pytest.mark.parametrize(
    "name, flops",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10G", 125e12),
        ("AMD Instinct MI300X", 1307e12),
        ("NVIDIA B200", 2250e12),
        ("Tesla T4", None),
    ],
)
def test_peak_flops_table(name, flops):
    assert peak_flops_for_name(name) == flops


def test_no_peak_on_cpu():
    assert device_peak_flops(torch.device("cpu")) is None
