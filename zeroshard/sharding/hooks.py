"""The module hooks the engine installs, and the identity that marks where a gradient enters a
module's backward.

Both the gradient path (zeroshard/grads/path.py: the root unit's hooks, the end-of-backward
callback, the fp16 loss scale) and stage 3's parameter schedule (zeroshard/sharding/schedule.py:
every other unit's gathers and frees) hook modules and module outputs the same way; they live
here, in the machinery's lowest folder, so that both can use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map


class _BackwardEntry(torch.autograd.Function):
    """Identity on the way forward; `on_grad(grad)` on the way back."""

    @staticmethod
    def forward(ctx, on_grad: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor):
        ctx.on_grad = on_grad
        # detach(), not view_as(): autograd forbids in-place ops on a view made inside a custom
        # Function, and the Trainer scales its loss in place (`loss *= ...`). detach() shares the
        # storage and the version counter, so an in-place op behaves as on the module's own output.
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, ctx.on_grad(grad)


def _inert(*args: Any, **kwargs: Any) -> None:
    return None


def _make_inert() -> Callable[..., None]:
    return _inert


class EngineHook:
    """A module hook of this engine's. A deep copy (the EMA pattern) or a pickle of the module
    gets an inert hook instead: the engine (its process groups) cannot be copied, and its
    schedule must not run for another module."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert

    def __reduce__(self):
        return _make_inert, ()


def wrap_outputs(output: Any, on_grad: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Pass every floating tensor of `output` that requires grad through `_BackwardEntry`."""

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            return _BackwardEntry.apply(on_grad, x)
        return x

    return tree_map(wrap, output)
