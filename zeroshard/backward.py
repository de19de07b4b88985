"""The backward protocol of DESIGN section 4.

Gradient readiness is tracked per unit with post-accumulate-grad hooks; the end of a
backward is detected by a callback queued on the autograd engine, not by counting hooks:

* Module outputs pass through `_BackwardEntry`, an identity whose backward runs in the
  outermost graph task before any of the module's own backward. It queues the end-of-
  backward callback there (so reentrant checkpointing, whose recomputation runs nested
  graph tasks, cannot end the backward early), applies the fp16 loss scale (so plain
  `loss.backward()` scales exactly as `engine.backward(loss)` does; each path from the loss
  into the model crosses exactly one entry, so nothing is scaled twice), and at stage 3
  gathers the unit's parameters before its backward needs them.
* A hook that fires while the model's forward is running (an autograd call inside forward,
  e.g. a tiled loss) only accumulates: it does not count towards a unit's readiness and
  queues nothing.
* Units are reduced in one fixed order (reverse of the model order, root last) as soon as
  they and every unit before them in that order are complete, so that every rank issues
  the same collectives in the same sequence; whatever is left (units with parameters that
  took no part, gradients that arrived late) is reduced by the end-of-backward callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from .unit import Unit


class _BackwardEntry(torch.autograd.Function):
    """Identity on the way forward; `on_grad(grad)` on the way back."""

    @staticmethod
    def forward(ctx, on_grad: Callable[[torch.Tensor], torch.Tensor], tensor: torch.Tensor):
        ctx.on_grad = on_grad
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, ctx.on_grad(grad)


def wrap_outputs(output: Any, on_grad: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Pass every floating tensor of `output` that requires grad through `_BackwardEntry`."""

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.requires_grad and x.is_floating_point():
            return _BackwardEntry.apply(on_grad, x)
        return x

    return tree_map(wrap, output)


class BackwardCoordinator:
    """Per-engine backward state: hooks, unit readiness, the end-of-backward callback.

    Args:
        units: the engine's units, root first.
        reduce_unit: queues one unit's local gradients for reduction (a full bucket is
            reduced at once: a collective).
        on_unit_done: called after a unit has been reduced during a backward (stage 3
            frees its parameters there).
        end_of_backward: the engine's epilogue, called once per backward with the units
            that still need a reduction (in reduce order): those not reduced during the
            backward and those that received gradients after their reduction.
        loss_scale: returns the current loss scale (1.0 when not scaling).
        reduces_now: whether this backward reduces gradients at all (then complete units
            are queued during it, and full buckets reduced while the backward goes on).
    """

    def __init__(
        self,
        units: list[Unit],
        reduce_unit: Callable[[Unit], None],
        on_unit_done: Callable[[Unit], None],
        end_of_backward: Callable[[list[Unit]], None],
        loss_scale: Callable[[], float],
        reduces_now: Callable[[], bool],
    ) -> None:
        self.units = units
        self.reduce_order = list(reversed(units[1:])) + units[:1]
        self._reduce_unit = reduce_unit
        self._on_unit_done = on_unit_done
        self._end_of_backward = end_of_backward
        self._loss_scale = loss_scale
        self._reduces_now = reduces_now
        self.sync_enabled = True  # False inside engine.no_sync()
        self.forward_depth = 0  # > 0 while the root module's forward runs
        self.in_backward = False
        self.callback_queued = False
        self.backward_count = 0  # epilogues run so far
        self._next_in_order = 0
        self._handles: list[Any] = []
        for unit in units:
            for flat in unit.flats:
                for index, p in enumerate(flat.params):
                    self._handles.append(
                        p.register_post_accumulate_grad_hook(self._make_hook(unit, flat, index))
                    )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------ forward side
    def root_pre_forward(self) -> None:
        self.forward_depth += 1

    def root_post_forward(self) -> None:
        self.forward_depth -= 1

    def root_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Backward of the root module's outputs: the start of a backward."""
        self._start_backward()
        scale = self._loss_scale()
        return grad if scale == 1.0 else grad * scale

    def _start_backward(self) -> None:
        if not self.in_backward:
            self.in_backward = True
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    # ----------------------------------------------------------- gradient side
    def _make_hook(self, unit: Unit, flat, index: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            grad = param.grad
            param.grad = None
            if grad is None:
                return
            if self.forward_depth > 0 and not self.in_backward:
                # An autograd call inside forward (a tiled loss): accumulate only. Its
                # gradient never crossed the loss scale, so scale it here as the rest will be.
                scale = self._loss_scale()
                flat.accumulate(index, grad if scale == 1.0 else grad * scale)
                unit.has_local_grad = True
                return
            flat.accumulate(index, grad)
            unit.has_local_grad = True
            if not self.callback_queued:
                # The loss did not come through the root module's outputs (e.g. the model
                # was called piecewise): fall back to queuing from the first hook.
                self._start_backward()
            unit.mark_fired(index, flat)
            if unit.complete and self._reduces_now():
                self._reduce_ready_in_order()

        return hook

    def _reduce_ready_in_order(self) -> None:
        while self._next_in_order < len(self.reduce_order):
            unit = self.reduce_order[self._next_in_order]
            if not unit.complete:
                return
            self._reduce_unit(unit)
            self._on_unit_done(unit)
            self._next_in_order += 1

    def _finish(self) -> None:
        """End of a backward: the autograd engine has finished the outermost graph task."""
        self.run_epilogue()

    def run_epilogue(self) -> None:
        done = self.reduce_order[: self._next_in_order]
        pending = [u for u in done if u.has_local_grad]  # late gradients
        pending += self.reduce_order[self._next_in_order :]
        self.in_backward = False
        self.callback_queued = False
        self._next_in_order = 0
        for unit in self.units:
            unit.reset_readiness()
        self.backward_count += 1
        self._end_of_backward(pending)
