"""Code that holds collectives runs eagerly under torch.compile: `runs_eagerly(reason)`.

[Note: eager regions]
A compiled unit (docs/compile.md, zeroshard/engine/compile.py) is traced by dynamo. Code that
moves data between ranks cannot be traced into one graph: the MoE layer's and AutoEP's token
exchanges have data-dependent sizes (their splits are read on the host), Ulysses attention
agrees on shapes with a small all-gather and exchanges heads for the sequence, and every
collective goes through comm/ with its recorder and its fault bookkeeping, which are Python.
Dynamo would break the graph somewhere inside, at a different place for each, or guard on the
recorder's state and recompile at every call. So the forward of each such layer is marked as an
eager region: while dynamo traces a unit, a call into it is a graph break at a known place
(the layer's call), the layer runs eagerly with its collectives, and tracing resumes after it.
Outside tracing the mark costs one check per call.

`torch.compiler.disable` does this, but applying it when a module is imported would import
dynamo (about 1.3 s) for every user of zeroshard; here the disabled function is made on first
need: when the mark is applied if dynamo is loaded already, else by `prepare_eager_regions`, which
every compile of a unit calls before anything is traced (a trace that found none would make it
itself, with more breaks at the same place).

The reason is kept on the wrapper (`EAGER_REASON`), so that what a unit runs eagerly can be
listed without tracing it (`eager_reason`).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["EAGER_REASON", "eager_reason", "prepare_eager_regions", "runs_eagerly"]

EAGER_REASON = "zeroshard_eager_reason"

F = TypeVar("F", bound=Callable[..., Any])


class _EagerRegion:
    """A function and, once made, the version of it that dynamo does not trace."""

    __slots__ = ("__weakref__", "disabled_fn", "fn", "reason")

    def __init__(self, fn: Callable[..., Any], reason: str) -> None:
        self.fn = fn
        self.reason = reason
        self.disabled_fn: Callable[..., Any] | None = None

    def disabled(self) -> Callable[..., Any]:
        if self.disabled_fn is None:
            self.disabled_fn = torch.compiler.disable(self.fn, recursive=True, reason=f"zeroshard: {self.reason}")
        return self.disabled_fn


# Weak: a region made for a closure (ALST's attention function) goes when its registration does.
_REGIONS: weakref.WeakSet[_EagerRegion] = weakref.WeakSet()


def runs_eagerly(reason: str) -> Callable[[F], F]:
    """Mark `fn` (a layer's forward, an attention function) as an eager region: see the note."""

    def mark(fn: F) -> F:
        region = _EagerRegion(fn, reason)
        _REGIONS.add(region)
        if "torch._dynamo" in sys.modules:  # dynamo is loaded: making it now costs nothing
            region.disabled()

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                return region.disabled()(*args, **kwargs)
            return fn(*args, **kwargs)

        setattr(wrapper, EAGER_REASON, reason)
        return wrapper  # type: ignore[return-value]

    return mark


def eager_reason(fn: Any) -> str | None:
    """Why `fn` runs eagerly under torch.compile (None: it is traced)."""
    return getattr(fn, EAGER_REASON, None)


def prepare_eager_regions() -> None:
    """Make every marked function's untraced version now, before dynamo traces anything."""
    for region in list(_REGIONS):
        region.disabled()
