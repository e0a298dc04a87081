"""Stop cleanly on preemption: a signal sets a flag, and all ranks agree on when to stop.

Schedulers (SLURM, Kubernetes) send SIGTERM, some SIGUSR1, a grace period before
SIGKILL. The handler only sets a flag; `should_stop()` all-reduces it (MAX) so every
rank sees the same answer at the same step, and the trainer saves and exits 0.
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
        group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """Install handlers for `signals` (main thread only); `group` defaults to the world."""
        self.group = group
        self._received: Optional[int] = None
        self._announced = False
        self._previous = {s: signal.signal(s, self._handle) for s in signals}

    def _handle(self, signum: int, frame: object) -> None:
        # Only record it: logging or collectives are not safe inside a signal handler.
        self._received = signum

    def should_stop(self) -> bool:
        """True on every rank once any rank got a signal (collective when distributed)."""
        stop = self._received is not None
        if dist.is_available() and dist.is_initialized():
            backend = dist.get_backend(self.group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            flag = torch.tensor([int(stop)], dtype=torch.int32, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        if stop and not self._announced:
            self._announced = True
            why = signal.Signals(self._received).name if self._received is not None else "another rank"
            logger.warning(f"preemption requested ({why}): saving a checkpoint and exiting")
        return stop

    def close(self) -> None:
        """Put back the handlers that were installed before."""
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
