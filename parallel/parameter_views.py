"""Parameters that are computed where they are used: the stored tensor stays the parameter.

A module's parameter attribute (`linear.weight`) normally returns the stored parameter. Here
the module's class is swapped for a subclass in which each of its parameter names is a
property: reading it returns `view(stored)`, e.g. the fp32 master weight cast to bf16, or
this rank's shard all-gathered into the full weight. Autograd carries the gradient back
through the view to the stored parameter, which the optimizer, gradient clipping and
checkpoints keep using unchanged.

Why a class swap and not `nn.utils.parametrize`: parametrize moves the stored tensor to
`parametrizations.<name>.original`, which renames every state-dict key (and so every
checkpoint and HF export). The swap changes nothing that `state_dict()`, `named_parameters()`
or `load_state_dict()` see, since those read `module._parameters`; FSDP2's `fully_shard`
and this project's activation checkpointing use the same trick. The view is computed inside
the module's forward, so under activation checkpointing and under `torch.compile` it is
recomputed in backward rather than a converted copy being kept from forward to backward.

Code that writes parameters in place through attributes (weight init) must run inside
`stored_parameters()`, where the attributes return the stored tensors.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

ParameterView = Callable[[torch.Tensor], torch.Tensor]


class _Access:
    """Whether parameter attributes currently return the stored tensors (see stored_parameters)."""

    stored = False


@contextlib.contextmanager
def stored_parameters() -> Iterator[None]:
    """Within this context, parameter attributes return the stored parameters themselves."""
    previous, _Access.stored = _Access.stored, True
    try:
        yield
    finally:
        _Access.stored = previous


def _view_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        stored = self._parameters[name]
        if _Access.stored or stored is None:
            return stored
        return self._parameter_views[name](stored)

    return property(get, doc=f"`{name}` as used in compute: a view of the stored parameter.")


_VIEW_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _view_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _VIEW_CLASSES:
        attributes = {name: _view_property(name) for name in names}
        _VIEW_CLASSES[key] = type(f"{cls.__name__}WithParameterViews", (cls,), attributes)
    return _VIEW_CLASSES[key]


def has_parameter_views(module: nn.Module) -> bool:
    return isinstance(module, tuple(_VIEW_CLASSES.values()))


def install_parameter_views(module: nn.Module, views: dict[str, ParameterView]) -> None:
    """Make each named parameter of `module` (its own, not its children's) read as `views[name](stored)`."""
    if has_parameter_views(module):
        raise ValueError(f"{type(module).__name__} already has parameter views")
    missing = [name for name in views if name not in module._parameters]
    if missing:
        raise KeyError(f"{type(module).__name__} has no parameters {missing}")
    module.__class__ = _view_class(type(module), tuple(sorted(views)))
    module._parameter_views = dict(views)


def modules_with_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Every module that holds parameters itself, in `model.modules()` order."""
    for module in model.modules():
        if any(p is not None for p in module._parameters.values()):
            yield module
