"""Which flat buffer holds each managed parameter, and what the full-tensor helpers read.

The engine fills one registry and tags each of its parameters with a weak reference to it,
so `safe_get_full_*` and `GatheredParameters` find a parameter's flat, the loss scale and
the optimizer without importing (or holding) the engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroshard.sharding.flat import FlatParamGroup

_REGISTRY_ATTR = "_zeroshard_registry"


class ParamRegistry:
    """The managed parameters of one engine.

    Args:
        flats: every flat buffer, in the engine's (collective) order.
        loss_scale: returns the current loss scale (1.0 when not scaling).
        optimizer: returns the optimizer stepping on the masters (None without one).
    """

    def __init__(
        self,
        flats: list[FlatParamGroup],
        loss_scale: Callable[[], float],
        optimizer: Callable[[], torch.optim.Optimizer | None],
    ) -> None:
        self.flats = flats
        self.loss_scale = loss_scale
        self.optimizer = optimizer
        self._index = {id(p): (flat, i) for flat in flats for i, p in enumerate(flat.params)}
        for flat in flats:
            for p in flat.params:
                setattr(p, _REGISTRY_ATTR, weakref.ref(self))

    def locate(self, param: nn.Parameter) -> tuple[FlatParamGroup, int]:
        """The flat buffer holding `param` and its index there."""
        try:
            return self._index[id(param)]
        except KeyError:
            raise ValueError(
                "this parameter is not managed by the engine (frozen, or from another model)"
            ) from None


def registry_of(param: Any) -> ParamRegistry:
    ref = getattr(param, _REGISTRY_ATTR, None)
    registry = ref() if ref is not None else None
    if registry is None:
        raise ValueError(
            "this parameter is not managed by a zeroshard engine: pass a parameter of "
            "engine.module (a frozen parameter has no master, gradient or optimizer state)."
        )
    return registry
