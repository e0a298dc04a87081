"""Timing of GPU work for the micro-benchmarks (bench_optimizer.py, bench_head_loss.py)."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(fn: Callable[[], object], steps: int, warmup: int) -> float:
    """Median ms of `fn` over `steps` calls after `warmup`, by CUDA events around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
