"""Process groups: start them with `[comm]`'s timeouts and flight recorder, or fake them for a dry run.

A collective that never completes (one rank died, or took another branch) hangs every other
rank until the process group's timeout, so weft keeps two timeouts, as torchtitan does:
`comm.init_timeout_seconds` from the start until the first step ends (building the meshes,
loading a checkpoint, compiling: a slow rank is normal there), then the tighter
`comm.train_timeout_seconds`. A timeout on NCCL dumps the flight recorder (the last
`comm.trace_buf_size` collectives of every process group, with their state and sizes) to
`<comm.save_traces_folder>/<comm.save_traces_file_prefix><rank>`; docs/planning.md shows how to
read the dumps with torch's `torchfrtrace`.

The private torch APIs this needs are isolated here, each with the versions checked.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from trainer.config import Comm

logger = logging.getLogger(__name__)

# The flight recorder reads these when the first NCCL communicator is created. Only the
# TORCH_FR_* names are set: the buffer size has been TORCH_FR_BUFFER_SIZE since torch 2.8 and
# the dump file TORCH_FR_DUMP_TEMP_FILE, and the old TORCH_NCCL_TRACE_BUFFER_SIZE /
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE make torch warn on every rank (2.13 for the buffer size, gloo
# included; 2.11 for the dump file). Checked on an H200 with torch 2.11: with only the new names
# a collective timeout dumps to the folder (scripts/check_flight_recorder.py on one GPU).
_BUFFER_SIZE = ("TORCH_FR_BUFFER_SIZE",)
_DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
_DUMP_FILE = ("TORCH_FR_DUMP_TEMP_FILE",)


def _set_env(names: tuple[str, ...], value: str) -> None:
    for name in names:
        previous = os.environ.get(name)
        if previous is not None and previous != value:
            logger.warning(f"{name}={previous} in the environment is replaced by {value} from [comm]")
        os.environ[name] = value


def configure_flight_recorder(trace_buf_size: int, folder: str, file_prefix: str) -> None:
    """Record the last `trace_buf_size` collectives per rank and dump them to
    `<folder>/<file_prefix><rank>` when a collective times out (0 turns recording off).
    Must run before the process group starts."""
    _set_env(_BUFFER_SIZE, str(trace_buf_size))
    if trace_buf_size > 0:
        os.makedirs(folder, exist_ok=True)
        _set_env(_DUMP_ON_TIMEOUT, "1")
        _set_env(_DUMP_FILE, os.path.join(folder, file_prefix))


def init_process_group(device: torch.device, comm: Comm, traces_folder: str) -> None:
    """Start the default process group (NCCL for CUDA tensors, gloo for CPU ones) with the init
    timeout and the flight recorder configured."""
    configure_flight_recorder(comm.trace_buf_size, traces_folder, comm.save_traces_file_prefix)
    timeout = timedelta(seconds=comm.init_timeout_seconds)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def set_timeout(seconds: int, groups: Iterable[ProcessGroup]) -> None:
    """Set the collective timeout of the default group and of `groups`.

    Groups made after `init_process_group` (a DeviceMesh's, say) start with torch's default
    timeout (30 min on gloo, 10 on NCCL: measured on 2.13), not the one the default group was
    given, so each is set here. torch has no public setter: `_set_pg_timeout` is private and
    present in 2.11 and 2.13 (torchtitan uses it the same way). Switching to a shorter timeout
    first waits on a barrier, so no rank starts timing collectives with it while another is
    still in work that the longer one was meant to cover.
    """
    from torch.distributed.distributed_c10d import _set_pg_timeout

    timeout = timedelta(seconds=seconds)
    dist.barrier()
    seen: set[int] = set()
    for group in (dist.group.WORLD, *groups):
        if id(group) not in seen:
            seen.add(id(group))
            _set_pg_timeout(timeout, group)


def init_fake_process_group(world_size: int) -> None:
    """A process group of `world_size` ranks in this one process, as rank 0: collectives return
    at once without moving data, so a plan for thousands of ranks can be built on one CPU.

    PyTorch ships the fake backend only under `torch.testing._internal` (importing the module
    registers the "fake" backend); present with this API in torch 2.11 and 2.13 (torchtitan's
    dry run uses it the same way).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
