"""Make a collective time out on purpose and check that the flight recorder dumped every rank.

GPU only (the dump on timeout is NCCL's watchdog). Run on 2 GPUs (or 1, see below):

    torchrun --nproc_per_node 2 scripts/check_flight_recorder.py /tmp/fr_check
    torchfrtrace /tmp/fr_check/comm_traces --prefix rank_ -j

The process group starts as weft's does (trainer/comm.py, `[comm]` defaults but a 10 s train
timeout); a few all-reduces succeed, then rank 0 issues one that rank 1 never joins. Rank 0's
watchdog times it out after 10 s, dumps, and takes the process down; rank 1 is asked (through
the store) to dump too. Expected: <folder>/comm_traces/rank_0 and rank_1 exist, and
`torchfrtrace` reports the all-reduce only rank 0 entered.

On one GPU (`--nproc_per_node 1`) there is no peer to withhold, so the last all-reduce is
queued behind a kernel that keeps the GPU busy for longer than the timeout: the same watchdog
path, one dump (rank_0), and the stuck all-reduce is the last entry, not completed.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer.comm import init_process_group, set_timeout  # noqa: E402
from trainer.config import load_config  # noqa: E402


def _keep_gpu_busy(device: torch.device, seconds: float) -> None:
    """Queue a kernel that spins for about `seconds` on the current stream.

    `torch.cuda._sleep(cycles)` is private (a spin kernel torch's own tests use; present in
    torch 2.11 and 2.13); the clock rate is measured rather than read, as the device
    properties do not report it on every version."""
    probe = 10**8
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize(device)
    cycles_per_second = probe / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(seconds * cycles_per_second))


def main() -> None:
    folder = sys.argv[1]
    comm = load_config(["--comm.train_timeout_seconds", "10"]).comm
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_process_group(device, comm, os.path.join(folder, "comm_traces"))
    x = torch.ones(1024, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    set_timeout(comm.train_timeout_seconds, [])
    if dist.get_world_size() == 1:
        _keep_gpu_busy(device, seconds=3 * comm.train_timeout_seconds)
        dist.all_reduce(x)  # waits behind the busy kernel past the timeout
        torch.cuda.synchronize()  # the watchdog ends the process before this returns
    elif dist.get_rank() == 0:
        dist.all_reduce(x)  # nobody joins
        torch.cuda.synchronize()  # the watchdog ends the process before this returns
    else:
        time.sleep(60)
    print(f"rank {dist.get_rank()}: still alive after the timeout; files: {os.listdir(os.path.join(folder, 'comm_traces'))}")


if __name__ == "__main__":
    main()
