"""A logged step's device values, read by the host one step late.

Why: reading a value from the GPU waits for all the work queued before it, and what the host
then does before its next launch (the metrics record, TensorBoard, the console, the next batch)
leaves the GPU idle. On one H100 the three reads of a logged step (non-finite flag, loss,
gradient norm) and the gap after them cost about 3.5 ms a step at `log_freq = 1`
(docs/performance.md). So at a logged step the trainer stages the values: one device-to-host
copy into pinned memory and an event, both queued behind the step. It then launches the next
step and only after that takes the values, by when the GPU is busy with that next step.

On a CPU the ops run as the host calls them, so there is nothing to hide: `deferred` is
False there and the trainer takes the values at once, which also keeps a record's time window
on the steps it counts.
"""

from __future__ import annotations

from typing import Generic, Sequence, TypeVar

import torch

Context = TypeVar("Context")


class StepReadout(Generic[Context]):
    """Holds at most one staged set of device scalars, with the host-side `context` the caller
    attached to them, until `take()`."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        self._ready = torch.cuda.Event() if self._cuda else None
        self._context: Context | None = None
        self._staged = False

    @property
    def deferred(self) -> bool:
        """Whether the device runs behind the host, so that taking the values later gains time."""
        return self._cuda

    def stage(self, values: Sequence[torch.Tensor], context: Context) -> None:
        """Queue one copy of `values` (device scalars) to the host; never waits for the device."""
        if self._staged:
            raise RuntimeError("StepReadout.stage: the values staged before were not taken yet")
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values])
        if self._host is None or self._host.numel() != stacked.numel():
            self._host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=self._cuda)
        self._host.copy_(stacked, non_blocking=True)
        if self._ready is not None:
            self._ready.record()
        self._context = context
        self._staged = True

    def take(self) -> tuple[list[float], Context] | None:
        """The staged values as floats and their context, waiting for the copy if it is still
        queued; None when nothing is staged."""
        if not self._staged:
            return None
        if self._ready is not None:
            self._ready.synchronize()
        context, self._context = self._context, None
        self._staged = False
        return self._host.tolist(), context
