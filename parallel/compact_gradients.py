"""One GPU: gradients kept in the compute dtype from backward to the optimizer step.

Without a data-parallel wrapper each fp32 master weight is cast to the compute dtype where it
is used (parallel/data_parallel.py), so autograd computes its gradient in that dtype and the
cast's backward widens it to fp32 on the way into `param.grad`: 4 bytes per parameter for a
value that fits in 2. At the end of backward every gradient is alive at once, next to the
parameters and optimizer state, and that is the step's memory peak whenever activations are
small (8B on one H200: 119.7 GiB of 139, of which 29.9 GiB are fp32 gradients).

Here the cast sends its gradient, unwidened, to a per-parameter *sink*: a leaf tensor of the
parameter's shape in the compute dtype whose storage is one element (all strides 0), so it
costs nothing while autograd accumulates the gradient into `sink.grad` as it would into a
bf16 parameter's. The optimizer step widens the gradients to fp32 a bounded group at a time
(`materialized`), which is the widening the cast's backward used to do, moved, not added; an
optimizer that reads bf16 gradients itself (`gradient_of`, trainer/triton_adamw.py) skips
the widening altogether, and the step can then run unit by unit (trainer/overlapped_step.py).
Numerically this is FSDP2's mixed precision: FSDP2 also holds the unsharded gradient in
`param_dtype` and widens it only to reduce it.

Weight copies (`keep_copies`, `training.compute_weight_copies`): the sink can instead be a
real compute-dtype copy of its parameter, which the cast's forward returns as it is. Forward
then reads the copy and casts nothing, and autograd accumulates the gradient into `copy.grad`
as into any sink. The copy must equal the cast bit for bit whenever forward runs: the Triton
AdamW writes it in the same pass that updates the parameter (`copy_of`), and anything else
that writes a parameter in place (initialization, a checkpoint load, another optimizer) bumps
the parameter's version counter, so `refresh_copies()`, called before every forward, casts
again exactly the parameters written since. The cost is 2 bytes per parameter held for the
whole run; under no AC that is the memory the casts kept for backward took anyway at
forward's end (the step's peak there), and the forward saves a 6-byte-per-parameter pass.

Limits: one micro-batch per step (a second would sum into the held gradient in the compute
dtype, where `param.grad` sums in fp32) and plain tensors (no tensor parallel), both checked
where the run is resolved. Parameters without a cast (the embedding table, looked up in fp32
with its rows summed in fp32) keep their ordinary fp32 `param.grad`.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from parallel.torch_internals import version_counter

# The fp32 gradients alive at once during the step: the largest parameter's, or this many
# bytes of smaller ones.
GROUP_BYTES = 1 << 30


class _CastIntoSink(torch.autograd.Function):
    """`stored.to(sink.dtype)`, whose gradient goes to `sink` as it is, and none to `stored`."""

    @staticmethod
    def forward(ctx, stored: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
        return stored.to(sink.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        return None, grad


def cast_into_sink(stored: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    return _CastIntoSink.apply(stored, sink)


def step_groups(parameters: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`parameters` in order, split into groups of at most GROUP_BYTES of fp32 gradient (a larger
    parameter is a group of its own): what the step widens at once."""
    groups: list[list[nn.Parameter]] = []
    size = GROUP_BYTES
    for p in parameters:
        nbytes = p.numel() * p.element_size()
        if size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


class CompactGradients:
    """The sinks of `parameters`: `sinks[p]` receives the gradient of `p`'s cast to `dtype`. With
    `keep_copies`, each sink is also `p`'s value in `dtype`, which forward reads in place of the cast."""

    def __init__(self, parameters: list[nn.Parameter], dtype: torch.dtype, keep_copies: bool = False) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        if len({id(p) for p in self.parameters}) != len(self.parameters):
            raise ValueError("a parameter read through two casts would sum its gradients in the compute dtype")
        self.keep_copies = keep_copies
        if keep_copies:
            # Laid out as the parameter: the Triton AdamW writes both at the same flat offsets.
            self.sinks = {p: torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).requires_grad_()
                          for p in self.parameters}
        else:
            self.sinks = {p: torch.empty_strided(p.shape, [0] * p.dim(), dtype=dtype, device=p.device).requires_grad_()
                          for p in self.parameters}
        self._copied_versions: dict[nn.Parameter, int] = {}

    @torch.no_grad()
    def refresh_copies(self) -> None:
        """With `keep_copies`: cast again every parameter written in place since its copy was
        made (its version counter moved; at first, all). Host-side bookkeeping only when none
        was: the Triton AdamW writes the copies itself and leaves the counters as they were."""
        if not self.keep_copies:
            return
        for p, copy in self.sinks.items():
            version = version_counter(p)
            if self._copied_versions.get(p) != version:
                copy.copy_(p)
                self._copied_versions[p] = version

    def copies(self) -> list[torch.Tensor]:
        """The weight copies (with `keep_copies`), or none."""
        return list(self.sinks.values()) if self.keep_copies else []

    def copy_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s compute-dtype copy, for the optimizer step to write, or None."""
        return self.sinks.get(param) if self.keep_copies else None

    def gradients(self) -> list[torch.Tensor]:
        """The gradients held now, in the compute dtype."""
        return [s.grad for s in self.sinks.values() if s.grad is not None]

    def gradient_of(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s gradient as held: its sink's, in the compute dtype, else its own `.grad`
        (where `torch.distributed.checkpoint` puts zeros to create the optimizer state). For an
        optimizer that reads gradients in any dtype (trainer/triton_adamw.py), which then needs
        no `materialized()` widening."""
        sink = self.sinks.get(param)
        held = sink.grad if sink is not None else None
        return held if held is not None else param.grad

    def holder_of(self, param: nn.Parameter) -> torch.Tensor:
        """The leaf tensor whose `.grad` autograd accumulates `param`'s gradient into: its sink, or itself."""
        return self.sinks.get(param, param)

    def release(self, params: list[nn.Parameter]) -> None:
        """Drop the gradients of `params`, held in their sinks or in `.grad`."""
        for p in params:
            p.grad = None
            sink = self.sinks.get(p)
            if sink is not None:
                sink.grad = None

    def materialized(self, others: list[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
        """Yield groups of parameters whose `.grad` is set to the fp32 gradient, one group at a time.

        `others` (parameters with an ordinary `.grad`, e.g. the embedding table) come first, as
        one group. After each group is yielded its `.grad` is cleared, so a step over the whole
        optimizer touches only that group; what a sink held is released as it is widened.
        """
        held = [p for p in self.parameters if self.sinks[p].grad is not None]
        if any(p in self.sinks for p in others):
            raise ValueError("a parameter got gradients both through its cast and directly (a tied weight?)")
        groups = ([others] if others else []) + step_groups(held)
        try:
            for group in groups:
                for p in group:
                    sink = self.sinks.get(p)
                    if sink is not None:
                        p.grad, sink.grad = sink.grad.to(p.dtype), None
                yield group
                for p in group:
                    p.grad = None
        finally:
            # After an error mid-step (the run then stops without saving), no gradient is left
            # behind; the groups before the failing one have been stepped.
            for group in groups:
                for p in group:
                    p.grad = None
            for sink in self.sinks.values():
                sink.grad = None
