"""Training metrics: one record per logged step to the console, TensorBoard and metrics.jsonl.

Only rank 0 writes. Throughput is averaged over the steps since the previous log (not the
last step alone), so `tps`, `tflops` and `mfu` are stable numbers that do not depend on
which step happened to hit a slow data batch. Definitions are in docs/metrics.md.

Backends are small `_Sink` objects (`write(step, values)`, `close()`); adding another
one (e.g. Weights & Biases) means writing one such class and appending it in
`MetricsLogger.__init__`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, TextIO

import torch

from trainer.compile_health import CompileHealth
from trainer.jsonl import JsonlWriter

# Dense (no 2:4 sparsity) bf16 tensor-core peak per device, FLOP/s, from the vendors'
# spec sheets. Matched as substrings of the device name; more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
)

_GIB = 1024**3


def peak_flops_for_name(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a device by its name, or None when it is not in the table."""
    lowered = device_name.lower()
    for key, flops in PEAK_BF16_FLOPS:
        if re.search(rf"\b{re.escape(key.lower())}\b", lowered):  # "L4" must not match "L40"
            return flops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of `device`; None on CPU or for an unknown accelerator."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def memory_stats(device: torch.device) -> dict[str, float | None]:
    """Peak memory since the previous call. CUDA peaks are reset after reading; on CPU the
    only cheap number is the process's lifetime max RSS, reported as "active"."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        reserved = stats.get("reserved_bytes.all.peak", 0)
        active = stats.get("active_bytes.all.peak", 0)
        torch.cuda.reset_peak_memory_stats(device)
        return {
            "memory_max_active_gib": active / _GIB,
            "memory_max_reserved_gib": reserved / _GIB,
            "memory_pct": 100.0 * reserved / total,
        }
    import resource

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = max_rss if sys.platform == "darwin" else max_rss * 1024  # Linux reports KiB
    return {"memory_max_active_gib": rss_bytes / _GIB, "memory_max_reserved_gib": None, "memory_pct": None}


def format_eta(seconds: float | None) -> str:
    """Compact remaining time: 42s, 5m07s, 1h02m, 2d03h."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


_COLORS = {"step": "36", "loss": "32", "speed": "33", "memory": "34", "warn": "31", "eta": "35"}


def _paint(text: str, role: str, color: bool) -> str:
    return f"\033[{_COLORS[role]}m{text}\033[0m" if color else text


def _num(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.4g}"


def format_console(record: dict[str, Any], total_steps: int, *, color: bool, extra_keys: tuple[str, ...] = ()) -> str:
    """One line per log: step/total, loss, grad_norm, lr, tps, tflops, mfu, memory, recompiles, ETA."""
    width = len(str(total_steps))
    parts = [_paint(f"step {record['step']:>{width}}/{total_steps}", "step", color)]
    if "loss" in record:
        parts.append(_paint(f"loss {record['loss']:.4f}", "loss", color))
    if "grad_norm" in record:
        parts.append(f"gnorm {_num(record['grad_norm'])}")
    if "lr" in record:
        parts.append(f"lr {record['lr']:.2e}")
    if "tps" in record:
        parts.append(_paint(f"tps {record['tps']:,.0f}", "speed", color))
    if "tflops" in record:
        parts.append(_paint(f"tflops {record['tflops']:.1f}", "speed", color))
    if record.get("mfu") is not None:
        parts.append(_paint(f"mfu {record['mfu']:.1f}%", "speed", color))
    if record.get("memory_max_active_gib") is not None:
        mem = f"mem {record['memory_max_active_gib']:.2f}GiB"
        if record.get("memory_pct") is not None:
            mem += f" ({record['memory_pct']:.0f}%)"
        parts.append(_paint(mem, "memory", color))
    if "recompiles" in record:
        new = record.get("recompiles_since_log", 0)
        text = f"recompiles {record['recompiles']}" + (f" (+{new})" if new else "")
        parts.append(_paint(text, "warn", color) if new else text)
    for key in extra_keys:
        parts.append(f"{key} {_num(float(record[key]))}")
    if "eta_s" in record:
        parts.append(_paint(f"eta {format_eta(record['eta_s'])}", "eta", color))
    return "  ".join(parts)


def _json_value(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class _Sink(Protocol):
    def write(self, step: int, values: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


_TB_GROUPS = {
    "loss": ("loss", "grad_norm", "lr"),
    "throughput": ("tps", "tflops", "mfu", "step_time_s", "data_time_pct", "eta_s"),
    "memory": ("memory_max_active_gib", "memory_max_reserved_gib", "memory_pct"),
    "compile": ("recompiles", "recompiles_since_log", "recompiles_after_warmup", "graph_breaks",
                "unique_graphs", "compile_time_s", "compile_time_first_s"),
}
_TB_GROUP_OF = {key: group for group, keys in _TB_GROUPS.items() for key in keys}


def tensorboard_tag(key: str) -> str:
    """`loss/loss`, `throughput/tps`, `memory/...`, `compile/...`; keys that name their group
    already (`validation/loss`) are kept, anything else goes under `other/`."""
    if "/" in key:
        return key
    return f"{_TB_GROUP_OF.get(key, 'other')}/{key}"


class _TensorBoardSink:
    """Scalars grouped by `tensorboard_tag`, the resolved config as a text entry. On resume,
    `purge_step` drops the events a crashed run wrote past its checkpoint, so each step shows once."""

    def __init__(self, log_dir: str, start_step: int, config_text: str | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imported only when enabled (slow)

        self.writer = SummaryWriter(log_dir=log_dir, purge_step=start_step + 1 if start_step else None)
        if config_text:
            indented = "\n".join("    " + line for line in config_text.splitlines())  # markdown code block
            self.writer.add_text("config", indented, start_step)

    def write(self, step: int, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(tensorboard_tag(key), value, step)

    def close(self) -> None:
        self.writer.close()


class _JsonlSink:
    """One JSON object per record; a resumed run continues the file after its checkpoint's step."""

    def __init__(self, path: str, start_step: int) -> None:
        self.writer = JsonlWriter(path, start_step)

    def write(self, step: int, values: dict[str, Any]) -> None:
        self.writer.write({"step": step, **{k: _json_value(v) for k, v in values.items() if k != "step"}})

    def close(self) -> None:
        self.writer.close()


@dataclass(frozen=True)
class Window:
    """The steps a record covers, closed by `MetricsLogger.end_window` at its last step."""

    step: int
    steps: int
    tokens: int
    data_seconds: float
    compile: dict[str, Any]


class MetricsLogger:
    """Times steps and writes one metrics record per logged step (rank 0 only).

    Per step: `step_begin()`, `data_loaded()` once the batch is on the device. At a logged
    step (`should_log(step)`) `end_window(step, tokens)` closes what the host knows of the
    window (its steps, tokens, data time, compile counters); `log(window, ...)` is called
    once the step's values have been read from the device, and that read ends the window's
    time. On a GPU the trainer reads them a step late (trainer/step_readout.py), so that the
    device never waits for the host's logging; a window's time runs from one read to the next.
    """

    def __init__(
        self,
        metrics_cfg: Any,
        *,
        dump_folder: str,
        rank: int,
        device: torch.device,
        flops_per_token: float,
        total_steps: int,
        compile_health: CompileHealth | None = None,
        peak_flops: float | None = None,
        stream: TextIO | None = None,
        tb_folder: str | None = None,
        start_step: int = 0,
        config_text: str | None = None,
    ) -> None:
        """`peak_flops` overrides the device table (for a device missing from it, or tests);
        `stream` is where the console line goes (default stdout); `tb_folder` defaults to
        `<dump_folder>/<metrics.save_tb_folder>`. `start_step` is the step the run resumes
        from (0 fresh): records past it, left by an earlier run, are dropped so that every step
        appears once. `config_text` (the resolved TOML) goes to TensorBoard as text."""
        self.log_freq = metrics_cfg.log_freq
        self.rank = rank
        self.device = device
        self.flops_per_token = flops_per_token
        self.total_steps = total_steps
        self.compile_health = compile_health
        self.peak_flops = peak_flops if peak_flops is not None else device_peak_flops(device)
        self.stream = stream if stream is not None else sys.stdout
        self.color = self.stream.isatty()
        self.sinks: list[_Sink] = []
        if rank == 0:
            os.makedirs(dump_folder, exist_ok=True)
            if metrics_cfg.enable_tensorboard:
                tb_folder = tb_folder or os.path.join(dump_folder, metrics_cfg.save_tb_folder)
                self.sinks.append(_TensorBoardSink(tb_folder, start_step, config_text))
            if metrics_cfg.enable_jsonl:
                self.sinks.append(_JsonlSink(os.path.join(dump_folder, "metrics.jsonl"), start_step))
        self._window_start: float | None = None  # set by the first step_begin(), then by each log()
        self._window_steps = 0
        self._data_time = 0.0
        self._excluded = 0.0
        self._step_start = 0.0

    def step_begin(self) -> None:
        now = time.perf_counter()
        if self._window_start is None:
            self._window_start = now
        self._step_start = now
        self._window_steps += 1

    def data_loaded(self) -> None:
        self._data_time += time.perf_counter() - self._step_start

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Time spent inside is left out of the window's time: validation, checkpoint saves."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._excluded += time.perf_counter() - start

    def should_log(self, step: int) -> bool:
        return step % self.log_freq == 0 or step == self.total_steps

    def end_window(self, step: int, tokens: int) -> Window:
        """Close the window at logged step `step`: `tokens` counts this device's tokens since
        the previous window. The compile counters are read now, before any later step compiles."""
        compile_fields = self.compile_health.snapshot(step) if self.compile_health is not None else {}
        window = Window(step=step, steps=max(self._window_steps, 1), tokens=tokens,
                        data_seconds=self._data_time, compile=compile_fields)
        self._window_steps = 0
        self._data_time = 0.0
        return window

    def log(
        self,
        window: Window,
        *,
        loss: float,
        grad_norm: float,
        lr: float,
        extra: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """Build, write (rank 0) and return the record of `window`. Call it right after the
        window's last step has finished on the device (reading its loss waits for that): the
        window's time ends now."""
        now = time.perf_counter()
        start = self._window_start if self._window_start is not None else now
        elapsed = max(now - start - self._excluded, 1e-9)
        tps = window.tokens / elapsed
        tflops = tps * self.flops_per_token / 1e12
        step_time = elapsed / window.steps
        record: dict[str, Any] = {
            "step": window.step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "lr": float(lr),
            "tps": tps,
            "tflops": tflops,
            "mfu": 100.0 * tflops * 1e12 / self.peak_flops if self.peak_flops else None,
            "step_time_s": step_time,
            "data_time_pct": 100.0 * window.data_seconds / elapsed,
            **memory_stats(self.device),
            "eta_s": step_time * max(self.total_steps - window.step, 0),
            **window.compile,
        }
        extra = {k: float(v) for k, v in (extra or {}).items()}
        record.update(extra)
        self._emit(window.step, record, tuple(extra))
        self._window_start = now
        self._excluded = 0.0
        return record

    def log_scalars(self, step: int, values: dict[str, float]) -> None:
        """Write scalars outside the training record, e.g. validation loss and perplexity."""
        values = {k: float(v) for k, v in values.items()}
        self._emit(step, {"step": step, **values}, tuple(values))

    def _emit(self, step: int, record: dict[str, Any], extra_keys: tuple[str, ...]) -> None:
        if self.rank != 0:
            return
        for sink in self.sinks:
            sink.write(step, record)
        line = format_console(record, self.total_steps, color=self.color, extra_keys=extra_keys)
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []
