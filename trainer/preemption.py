"""Stop cleanly on preemption: a signal sets a flag, and all ranks agree on when to stop.

Schedulers (SLURM, Kubernetes) send SIGTERM, some SIGUSR1, a grace period before SIGKILL.
The handler only sets a flag. Every `check_freq` steps the ranks agree on it with an
all-reduce (MAX) of a CPU tensor, which the default process group routes to gloo: it costs
a few hundred microseconds of CPU time and never waits for the GPU, so the training step
keeps no device sync for it. Every rank then stops at the same step, saves and exits 0.
"""

from __future__ import annotations

import logging
import signal
from typing import Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class PreemptionHandler:
    def __init__(
        self,
        signals: tuple[signal.Signals, ...] = (signal.SIGTERM,),
        check_freq: int = 1,
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Install handlers for `signals` (main thread only). `group` (default: the world) must
        handle CPU tensors: gloo, or a "cpu:gloo,cuda:nccl" group."""
        self.group = group
        self.check_freq = check_freq
        self._received: Optional[int] = None
        self._announced = False
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: object) -> None:
        # Only record it: logging or collectives are not safe inside a signal handler.
        self._received = signum

    def should_stop(self, step: int, *, force_check: bool = False) -> bool:
        """True on every rank, at the same step, once any rank got a signal. Collective on the
        steps it checks (multiples of `check_freq`, and `force_check`), which every rank
        must reach together."""
        if step % self.check_freq and not force_check:
            return False
        stop = self._received is not None
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(stop)], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        if stop and not self._announced:
            self._announced = True
            why = signal.Signals(self._received).name if self._received is not None else "another rank"
            logger.warning(f"preemption requested ({why}) at step {step}: saving a checkpoint and exiting")
        return stop

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
