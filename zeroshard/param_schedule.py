"""Stage 3's parameter schedule: when each unit's full parameters are gathered and freed.

A unit's parameters exist only around its forward and its backward (DESIGN section 3):

* forward: gathered by the unit's forward pre-hook, freed by its forward hook (the root unit
  stays gathered for the whole forward: its parameters may be used anywhere);
* backward: gathered when the gradient reaches the unit's outputs, freed once the gradient
  path has queued its gradient for reduction (`unit_reduced`), and at the end of every
  backward whatever is left;
* prefetch: while a unit computes, the units that follow it in the last forward's order (or
  precede it, going backwards) start gathering, up to `stage3_prefetch_bucket_size`
  elements;
* a forward inside a backward is an activation checkpoint's recomputation: its parameters
  stay gathered for the backward that follows, and it prefetches in backward order.

The root module's hooks belong to the gradient path (zeroshard/grad_path.py), which calls
`root_pre_forward`, `root_post_forward` and `root_backward` here; this class installs the
hooks of the other units itself. At stages 0-2 there is no schedule (parameters stay whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .grad_path import wrap_outputs
from .unit import Unit


class ParamSchedule:
    """Gathers, prefetches and frees stage-3 units.

    Args:
        units: the engine's units, root first.
        prefetch_numel: stage3_prefetch_bucket_size (elements gathered ahead).
        in_backward: whether a backward is running now (the gradient path knows).
    """

    def __init__(self, units: list[Unit], prefetch_numel: int, in_backward: Callable[[], bool]) -> None:
        self.units = units
        self.root = units[0]
        self.prefetch_numel = prefetch_numel
        self._in_backward = in_backward
        self._order_now: list[Unit] = []  # units in the order the running forward used them
        self._forward_order: list[Unit] = []  # the last complete forward's order
        self._position: dict[int, int] = {}
        self._handles: list[Any] = []
        for unit in units[1:]:
            self._handles.append(unit.module.register_forward_pre_hook(self._unit_pre(unit)))
            self._handles.append(unit.module.register_forward_hook(self._unit_post(unit)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -------------------------------------------------------------- root module
    def root_pre_forward(self, outermost: bool) -> None:
        if outermost and not self._in_backward():
            self._order_now = []
        self.root.gather()

    def root_post_forward(self, outermost: bool) -> None:
        if outermost and not self._in_backward():
            if self._order_now:
                self._forward_order = list(self._order_now)
                self._position = {id(u): i for i, u in enumerate(self._forward_order)}
            self.free_all()  # including prefetched units the forward did not reach

    def root_backward(self) -> None:
        self.root.gather()

    # ----------------------------------------------------------- gradient path
    def unit_reduced(self, unit: Unit) -> None:
        """The unit's gradient is queued for reduction: its parameters are not needed until
        the next forward (the root unit's may still be, by any later unit's backward)."""
        if unit is not self.root:
            unit.free()

    def free_all(self) -> None:
        for unit in self.units:
            unit.free()  # a no-op for units that keep their full parameters (resident)

    # ------------------------------------------------------------ other units
    def _unit_pre(self, unit: Unit):
        def pre(module, args):
            unit.gather()
            if self._in_backward():
                self._prefetch(unit, -1)  # a checkpoint's recomputation: backward order
            else:
                self._order_now.append(unit)
                self._prefetch(unit, +1)

        return pre

    def _unit_post(self, unit: Unit):
        def post(module, args, output):
            # During a backward the forward is a checkpoint's recomputation: the backward
            # that follows needs the parameters, so they are freed after it instead.
            if not self._in_backward():
                unit.free()

            def on_grad(grad):
                unit.gather()
                self._prefetch(unit, -1)
                return grad

            return wrap_outputs(output, on_grad)

        return post

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Start gathering the units that follow `unit` in the last forward's order (or
        precede it, going backwards), up to `prefetch_numel` elements."""
        position = self._position.get(id(unit))
        if position is None:
            return
        budget = self.prefetch_numel
        j = position + direction
        while 0 <= j < len(self._forward_order):
            nxt = self._forward_order[j]
            if nxt.numel > budget:
                return
            budget -= nxt.numel
            nxt.start_gather()
            j += direction
