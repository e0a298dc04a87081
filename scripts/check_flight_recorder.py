"""Make a collective time out on purpose and check that the flight recorder dumped every rank.

GPU only (the dump on timeout is NCCL's watchdog). Run on 2 GPUs:

    torchrun --nproc_per_node 2 scripts/check_flight_recorder.py /tmp/fr_check
    torchfrtrace /tmp/fr_check/comm_traces --prefix rank_ -j

The process group starts as weft's does (trainer/comm.py, `[comm]` defaults but a 10 s train
timeout); a few all-reduces succeed, then rank 0 issues one that rank 1 never joins. Rank 0's
watchdog times it out after 10 s, dumps, and takes the process down; rank 1 is asked (through
the store) to dump too. Expected: <folder>/comm_traces/rank_0 and rank_1 exist, and
`torchfrtrace` reports the all-reduce only rank 0 entered.
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


def main() -> None:
    folder = sys.argv[1]
    comm = load_config(["--comm.train_timeout_seconds", "10"]).comm
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_process_group(device, comm, os.path.join(folder, "comm_traces"))
    x = torch.ones(1024, device=device)
    for _ in range(3):
        dist.all_reduce(x)
    set_timeout(comm.train_timeout_seconds, [])
    if dist.get_rank() == 0:
        dist.all_reduce(x)  # nobody joins
        torch.cuda.synchronize()  # the watchdog ends the process before this returns
    else:
        time.sleep(60)
    print(f"rank {dist.get_rank()}: still alive after the timeout; files: {os.listdir(os.path.join(folder, 'comm_traces'))}")


if __name__ == "__main__":
    main()
