"""Run a function in N CPU processes joined by a gloo process group (for multi-rank tests)."""

from __future__ import annotations

import os
import socket
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


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

