"""Each unit's gradient norms, taken during backward as soon as the unit's gradients are final.

Why: the clip needs the norm of every gradient before any parameter steps, and taken after
backward that norm is a memory-bound pass over all of them on the critical path (the 3B
model's bf16 compact gradients are 6.4 GB: about 1.5 ms on an H200). A unit's gradients (one
block's, say) are final once autograd has accumulated them, long before backward ends. On a
GPU a side stream reads them there, beside the matmuls of the units backward has yet to run.

Numerics: the norms are the per-tensor fp64 norms `global_norm` takes after backward
(parallel/grad_clip.py), and it combines them in the same order, so the total is the same
bits. That holds because `torch._foreach_norm` computes each tensor's norm on its own,
whatever list the tensor is in (on CUDA each tensor's chunk partials are reduced per tensor,
ATen's ForeachReduceOp.cu, torch 2.11-2.13; on a CPU it is one norm per tensor). Within one
backward autograd sums a leaf's uses before accumulating them, so a unit is complete when each
of its leaves has been accumulated once. A gradient written again after its norm was taken (a
reentrant checkpoint runs a backward of its own inside backward) has a new version or is a new
tensor; its norm is taken again at the end, with any norm not taken during backward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from parallel.fsdp import FSDPUnit, unit_of
from parallel.grad_clip import TensorNorms, norm_groups
from parallel.torch_internals import version_counter


def unit_holders(
    units: Sequence[FSDPUnit], parameters: Iterable[nn.Parameter], holder_of: Callable[[nn.Parameter], torch.Tensor]
) -> list[list[torch.Tensor]]:
    """Per unit, the leaves `holder_of` gives for its trainable `parameters`: the tensors whose
    `.grad` autograd accumulates their gradients into (`BackwardGradNorms`'s `units`)."""
    owner = unit_of(units)
    holders: list[list[torch.Tensor]] = [[] for _ in units]
    for p in parameters:
        if p.requires_grad:
            holders[owner(p)].append(holder_of(p))
    return holders


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class BackwardGradNorms:
    """Takes each unit's gradient norms once autograd has accumulated all of that unit's gradients.

    `units` holds, per unit, the leaf tensors whose `.grad` the clip reads (parameters, or the
    sinks of compact gradients). `arm()` before the backward whose gradients are clipped (the
    last micro-batch's); after it, `norms(grads)` gives the per-tensor norms of `grads`
    (`norm_fn`'s, taken then or, where a gradient was not final until the end, now), and
    `disarm()` drops them.
    """

    def __init__(self, units: Sequence[Sequence[torch.Tensor]], norm_fn: TensorNorms, device: torch.device) -> None:
        self._norm_fn = norm_fn
        self._units = [list(unit) for unit in units]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._armed = False
        self._ready: list[set[int]] = [set() for _ in self._units]
        # id(grad) -> (the grad, weakly; its version when its norm was launched; the norm)
        self._taken: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        for index, unit in enumerate(self._units):
            for leaf in unit:
                leaf.register_post_accumulate_grad_hook(self._accumulated_hook(index))

    def _accumulated_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(leaf: torch.Tensor) -> None:
            if not self._armed:
                return
            ready = self._ready[index]
            if id(leaf) in ready:  # accumulated again: its version moved, so `norms` takes it again
                return
            ready.add(id(leaf))
            if len(ready) == len(self._units[index]):
                self._launch([leaf.grad for leaf in self._units[index]])

        return hook

    @torch.no_grad()
    def _launch(self, grads: list[torch.Tensor]) -> None:
        """The norms of `grads`, on the side stream once what autograd queued so far is done."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            for group in norm_groups(grads):  # as `global_norm` groups them: one dtype per list
                for grad, norm in zip(group, self._norm_fn(group)):
                    self._taken[id(grad)] = (weakref.ref(grad), version_counter(grad), norm)

    def arm(self) -> None:
        """Take norms during the next backward (the one whose gradients the clip reads)."""
        self.disarm()
        self._armed = True

    def disarm(self) -> None:
        """Take no norms in backward until the next `arm()`, and drop those taken."""
        self._armed = False
        self._ready = [set() for _ in self._units]
        self._taken.clear()

    @torch.no_grad()
    def norms(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-tensor norms of `grads`: those taken during backward where the gradient is still
        the tensor it was then, at the same version; the others taken now."""
        if self._stream is not None:
            main = torch.cuda.current_stream(self._stream.device)
            main.wait_stream(self._stream)
        found: list[torch.Tensor | None] = []
        for grad in grads:
            entry = self._taken.get(id(grad))
            fresh = entry is not None and entry[0]() is grad and entry[1] == version_counter(grad)
            found.append(entry[2] if fresh else None)
            if fresh and self._stream is not None:
                _local(entry[2]).record_stream(main)  # made on the side stream, read and freed on this one
        missing = [grad for grad, norm in zip(grads, found) if norm is None]
        late = iter(self._norm_fn(missing) if missing else [])
        return [norm if norm is not None else next(late) for norm in found]
