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
    schedule must not run for another module.

    Under torch.compile (docs/compile.md) the engine compiles a unit's `forward`, so its own
    module hooks run outside the graph. A hook dynamo meets anyway (a module the user compiled
    with `module.compile()`, whose compiled `_call_impl` holds the hooks) runs eagerly, with a
    graph break around it: it gathers, frees and counts in Python. `traceable` hooks are the
    exception: stage 3's hooks on a unit's submodules, which inside the unit's own forward only
    read one flag (zeroshard/sharding/schedule.py) and must not break the unit's graph.
    """

    __slots__ = ("fn", "traceable")

    def __init__(self, fn: Callable[..., Any], traceable: bool = False) -> None:
        self.fn = fn
        self.traceable = traceable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.traceable:
            return self.fn(*args, **kwargs)
        return call_eagerly(self.fn, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Callable[..., None]:
        return _inert

    def __reduce__(self):
        return _make_inert, ()


def call_eagerly(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, which dynamo does not trace when it meets this call (a graph break
    around it); a plain call otherwise."""
    if torch.compiler.is_compiling():
        # Made here, not at import: torch.compiler.disable imports dynamo (seconds). Dynamo
        # runs this line eagerly too (it never traces torch.compiler), then `fn`.
        return torch.compiler.disable(fn, recursive=True, reason="zeroshard: an engine hook")(*args, **kwargs)
    return fn(*args, **kwargs)


def wrap_outputs(output: Any, on_grad: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Pass every floating tensor of `output` that requires grad through `_BackwardEntry`."""

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            return _BackwardEntry.apply(on_grad, x)
        return x

    return tree_map(wrap, output)
