"""Run a function in N CPU processes joined by a gloo process group (for multi-rank tests)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multi_rank_env() -> dict[str, str]:
    """Environment for a test's torchrun launch of several CPU ranks on a 2-core machine.

    One thread each for ops (OMP) and for inductor's compiles (TORCHINDUCTOR_COMPILE_THREADS):
    with 4 ranks on 2 cores, more threads only contend, and compiling in the rank's own thread
    keeps inductor's compile pool (a thread pool on CPU, worker subprocesses for Triton) out of
    processes that also run gloo's threads. PYTHONFAULTHANDLER makes a rank that dies of a
    signal print every thread's Python stack (a rank of the compile-parity launch died of
    SIGSEGV in CI with the pool on, and of SIGABRT with it off: see
    tests/test_parallel_parity.launch).
    """
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONFAULTHANDLER": "1", "CUDA_VISIBLE_DEVICES": ""}


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_without_finalizing()


def exit_without_finalizing() -> None:
    """End a rank that passed its checks and destroyed its process group, skipping interpreter
    finalization.

    A gloo worker thread frees the work object of the last collective after `wait()` has
    returned, and freeing its tensors takes the GIL. When the rank has already begun to
    finalize, that thread is made to exit inside a noexcept destructor and the process aborts
    ("terminate called without an active exception", SIGABRT; one 2-rank check in about 30
    failed so on torch 2.13 CPU, core dump: ~AsyncAllgatherWork in ProcessGroupGloo::runLoop).
    Nothing is left to finalize here: results are written and the group is destroyed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """`fn(rank, world_size, *args)` in each process; raises if any process fails."""
    mp.spawn(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)


def split_driver_args(argv: list[str]) -> tuple[str, list[str], list[list[str]]]:
    """A driver's `OUT.json BASE_ARGS... -- RUN_ARGS... -- RUN_ARGS...` as (out, base, runs)."""
    out_path, *rest = argv
    groups: list[list[str]] = [[]]
    for arg in rest:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    return out_path, groups[0], groups[1:]

