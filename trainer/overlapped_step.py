"""The optimizer step, unit by unit on a side stream, overlapped with the next step's forward.

Why: on one GPU the AdamW step is memory-bound (28 bytes per parameter: 39 ms per step at 3B
on an H200, docs/performance.md) and runs while the matmul units idle, and the next forward
is mostly matmuls. A unit's parameters (the embedding, one block, norm + head: the model's
data-parallel units) are not read again until that unit's forward, so the trainer launches
the step of each unit, in forward order, on a side stream, and each unit's forward first
waits for its own step. Only the first unit's step stays on the critical path; the others
run beside the forward of the units before them.

Numerics are unchanged: the same optimizer, hyper-parameters and kernels update the same
values (AdamW is elementwise, so stepping unit by unit changes no bit), and the clip factor
(`optimizer.grad_scale`) is computed before any unit steps.

Gradients: a unit's gradients are released when its forward begins, after the main stream
has waited for that unit's step, so the caching allocator hands their memory to the forward's
activations at once (`record_stream` would hold every gradient until the whole step is done,
reserving memory beside the forward's). The forward's first unit thus starts with the other
units' gradients still alive; by the end of forward they are gone, as before.

On a CPU there is no stream to overlap with: the units step in place, in the same order, and
their gradients are released as on a GPU (this is what the CPU tests exercise).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch
from torch import nn

from parallel.fsdp import FSDPUnit, unit_modules, unit_of


def _clear_grads(params: list[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


class OverlappedStep:
    """Steps `optimizer` one unit at a time, each unit's step finished only when its forward needs it.

    `units` are in forward order; parameters in no unit step with the first. Call `step()`
    where `optimizer.step()` would be (with `optimizer.grad_scale` set, if any), never
    `optimizer.zero_grad()` for these parameters (each unit's forward releases its
    gradients, through `release(params)`: by default it clears their `.grad`; compact
    gradients pass `CompactGradients.release`), and `finish()` before anything else reads the
    parameters, the optimizer state or the gradients: a checkpoint save, an export, the next
    backward.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        units: Sequence[FSDPUnit],
        device: torch.device,
        release: Callable[[list[nn.Parameter]], None] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self._release = release or _clear_grads
        modules_of_units = [unit_modules(unit) for unit in units]
        owner = unit_of(units)
        # Per unit, per optimizer param group: the group's parameters that belong to the unit.
        self._group_params = [
            [[p for p in group["params"] if owner(p) == index] for group in optimizer.param_groups]
            for index in range(len(modules_of_units))
        ]
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._events = [torch.cuda.Event() if self._stream is not None else None for _ in modules_of_units]
        self._pending = [False] * len(modules_of_units)
        self._on_side_stream = False  # whether the pending steps run on the side stream
        self._in_flight: list[torch.Tensor] = []  # small tensors the side stream reads (the clip factor)
        for index, modules in enumerate(modules_of_units):
            hook = self._forward_pre_hook(index)
            for module in modules:
                module.register_forward_pre_hook(hook)

    def _forward_pre_hook(self, index: int):
        # Outside any compiled graph: a per-block compiled block runs it eagerly before its
        # graph (no graph break; checked on torch 2.11 and 2.13). Whole-model compile would
        # break its graph here, so the trainer does not overlap the step there.
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple) -> None:
            self._settle(index)

        return hook

    @contextlib.contextmanager
    def _only_unit(self, index: int):
        """The optimizer sees only unit `index`'s parameters, so `step()` updates just those.
        Its state is keyed by parameter, so nothing else changes."""
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, self._group_params[index]):
                group["params"] = params
            yield
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    @torch.no_grad()
    def step(self) -> None:
        """Launch every unit's step, in forward order; on a CPU, run them."""
        self.finish()
        grad_scale = getattr(self.optimizer, "grad_scale", None)
        if grad_scale is not None:
            self._in_flight.append(grad_scale)
        # The first step creates AdamW's state (2 fp32 copies of every parameter). Created on
        # the side stream, it would take new memory in that stream's pool while the memory the
        # first backward freed stays reserved, unused, in the main stream's; so it steps there.
        stream = self._stream if self.optimizer.state else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for index in range(len(self._group_params)):
                with self._only_unit(index):
                    self.optimizer.step()
                if stream is not None:
                    self._events[index].record(stream)
                self._pending[index] = True
        self._on_side_stream = stream is not None

    def _settle(self, index: int) -> None:
        """Make the current stream wait for unit `index`'s step, then release its gradients."""
        if not self._pending[index]:
            return
        self._pending[index] = False
        if self._on_side_stream:
            torch.cuda.current_stream(self._stream.device).wait_event(self._events[index])
        for params in self._group_params[index]:
            self._release(params)
        if not any(self._pending):
            self._in_flight.clear()

    def finish(self) -> None:
        """Wait for every unit's step still pending and release its gradients."""
        for index in range(len(self._pending)):
            self._settle(index)
