"""torch.profiler traces and CUDA memory snapshots, every `profile_freq` steps."""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Iterator

import torch

from trainer.config import Profiling


class _NoOp:
    def step(self) -> None:
        pass


@contextlib.contextmanager
def maybe_profile(cfg: Profiling, *, folder: str, rank: int, start_step: int) -> Iterator[object]:
    """Yield an object whose `step()` is called once per training step.

    When enabled, the step before each multiple of `profile_freq` warms the profiler up and
    the multiple itself is recorded to `<folder>/iteration_<N>/rank<R>_trace.json`.
    """
    if not cfg.enable_profiling:
        yield _NoOp()
        return
    step = [start_step]

    def on_trace_ready(prof: torch.profiler.profile) -> None:
        out = os.path.join(folder, f"iteration_{step[0]}")
        os.makedirs(out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out, f"rank{rank}_trace.json"))

    freq = cfg.profile_freq
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    wait = max(freq - 2, 0) if freq > 1 else 0
    schedule = torch.profiler.schedule(wait=wait, warmup=1 if freq > 1 else 0, active=1, skip_first=(-start_step) % freq)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=on_trace_ready) as prof:
        class _Stepper:
            def step(self) -> None:
                step[0] += 1
                prof.step()

        yield _Stepper()


@contextlib.contextmanager
def maybe_memory_snapshot(cfg: Profiling, *, folder: str, rank: int, device: torch.device, start_step: int) -> Iterator[object]:
    """Record CUDA allocator history and dump a snapshot every `profile_freq` steps (GPU only).

    Uses torch.cuda.memory._record_memory_history / _snapshot: private but the documented way
    to produce files for pytorch.org/memory_viz (checked on torch 2.11 and 2.13).
    """
    if not (cfg.enable_memory_snapshot and device.type == "cuda"):
        yield _NoOp()
        return
    torch.cuda.memory._record_memory_history(max_entries=100000)
    step = [start_step]

    class _Snapshotter:
        def step(self) -> None:
            step[0] += 1
            if step[0] % cfg.profile_freq == 0:
                out = os.path.join(folder, f"iteration_{step[0]}")
                os.makedirs(out, exist_ok=True)
                with open(os.path.join(out, f"rank{rank}_memory_snapshot.pickle"), "wb") as f:
                    pickle.dump(torch.cuda.memory._snapshot(), f)

    try:
        yield _Snapshotter()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

