"""The gradient path: from a parameter's post-accumulate hook to its reduced shard.

One owner, this file (docs/design.md section 4); it writes into the flat buffers' gradient buffers
(zeroshard/grads/buffers.py) and reduces them through the bucketed reducer (zeroshard/grads/reduce.py).
Follow a gradient:

1. The autograd engine accumulates `p.grad`; the post-accumulate hook (`_make_hook`) moves
   it into its flat's local buffer (`flat.grads.accumulate`, in the accumulation dtype) and marks
   the parameter as fired in its unit.
2. When a unit is ready (every parameter's hook fired, or at stage 3 the backward reached the
   unit's inputs: zeroshard/sharding/schedule.py's note) and this backward reduces
   (`reduces_now`: every synced backward at stages 2-3, the synced boundary backward at
   stages 0-1), units are queued for reduction in
   one fixed order (reverse model order, root last) as soon as they and every unit before
   them are complete, so every rank issues the same collectives in the same sequence
   (`_reduce_ready_in_order` -> `GradientReducer.add`: a full bucket is reduced at once,
   asynchronously, while the backward goes on). At stage 3 the unit's parameters are then
   freed (`ParamSchedule.unit_reduced`).
3. At the end of the backward (`_finish`, a callback queued on the autograd engine) whatever
   is left is queued (units with parameters that took no part, gradients that arrived late),
   the reducer finishes every bucket and writes each result, divided by world size x k,
   into `flat.grads.reduced` (the whole gradient at stages 0-1, where `param.grad` then views
   it: zeroshard/grads/views.py; this rank's shard at stages 2-3).
4. A backward that does not reduce (no_sync, or a non-boundary micro-step at stages 0-1)
   leaves the local gradient; `flush` reduces it before the step.

How the end of a backward is found, not by counting hooks:

* Module outputs pass through `_BackwardEntry` (zeroshard/sharding/hooks.py), an identity whose backward runs in the
  outermost graph task before any of the module's own backward. It queues the end-of-
  backward callback there (so reentrant checkpointing, whose recomputation runs nested
  graph tasks, cannot end the backward early), applies the fp16 loss scale (so plain
  `loss.backward()` scales exactly as `engine.backward(loss)` does; each path from the loss
  into the model crosses exactly one entry, so nothing is scaled twice), and at stage 3
  gathers the root unit's parameters before its backward needs them.
* A hook that fires while the model's forward is running (an autograd call inside forward,
  e.g. a tiled loss) only accumulates: it does not count towards a unit's readiness and
  queues nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from zeroshard.grads.accumulation import Accumulation
from zeroshard.grads.reduce import GradientReducer
from zeroshard.sharding.hooks import EngineHook, wrap_outputs
from zeroshard.sharding.stages import StagePolicy

if TYPE_CHECKING:
    from zeroshard.grads.views import GradViews
    from zeroshard.sharding.schedule import ParamSchedule
    from zeroshard.sharding.unit import Unit


class GradientPath:
    """Per-engine gradient state: hooks, unit readiness, reductions, the end of a backward.

    Args:
        root: the module whose outputs start a backward (the engine's module).
        units: the engine's units, root first.
        policy: the stage (when backward calls reduce).
        reducer: the bucketed reducer every flat's gradient goes through.
        accumulation: where accumulation stands (zeroshard/grads/accumulation.py), shared
            with the engine: this path marks forwards and backwards there, and reads from it
            whether a backward reduces.
        loss_scale: returns the loss scale to apply where a gradient enters the model (1.0
            when not scaling, or when the loss was scaled already).
        views: stages 0-1's `param.grad` views of the reduced gradient (None elsewhere).
        params: stage 3's gather and free schedule (None when parameters stay whole).
    """

    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        policy: StagePolicy,
        reducer: GradientReducer,
        accumulation: Accumulation,
        loss_scale: Callable[[], float],
        views: GradViews | None = None,
        params: ParamSchedule | None = None,
    ) -> None:
        self.units = units
        self.reduce_order = list(reversed(units[1:])) + units[:1]
        self.policy = policy
        self.reducer = reducer
        self.state = accumulation
        self._loss_scale = loss_scale
        self.params = params
        self.views = views
        self.forward_depth = 0  # > 0 while the root module's forward runs
        self.callback_queued = False
        self._next_in_order = 0
        self._handles: list[Any] = [
            root.register_forward_pre_hook(EngineHook(self._root_pre), prepend=True),
            root.register_forward_hook(EngineHook(self._root_post), always_call=True),
        ]
        views_possible = not policy.scatter and not policy.reduce_every_backward  # stages 0-1 (views.py)
        for unit in units:
            for flat in unit.flats:
                for index, p in enumerate(flat.params):
                    if views_possible:
                        self._handles.append(p.register_hook(EngineHook(self._drop_views_before_accumulation)))
                    self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(unit, flat, index)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _drop_views_before_accumulation(self, grad: torch.Tensor) -> torch.Tensor:
        """A leaf's tensor hook, run before autograd accumulates into `.grad`: a backward that
        follows the boundary backward with no forward between (through a retained graph) must
        not add into the `.grad` views of the reduced gradient (it would count that gradient
        twice), so the views go first."""
        if self.views is not None and self.views.exposed:
            self.views.clear()
        return grad

    # ------------------------------------------------------------ forward side
    def _root_pre(self, module, args) -> None:
        if self.views is not None:
            self.views.clear()  # no later backward may accumulate into the reduced buffer
        self.forward_depth += 1
        if self.forward_depth == 1:
            self.state.forward_started(training=module.training and torch.is_grad_enabled())
        if self.params is not None:
            self.params.root_pre_forward(outermost=self.forward_depth == 1)

    def _root_post(self, module, args, output):
        self.forward_depth -= 1
        if self.params is not None:
            needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(output))
            self.params.root_post_forward(outermost=self.forward_depth == 0, backward_may_follow=needs_grad)
        if output is None:
            return None
        return wrap_outputs(output, self._root_output_grad)

    def _root_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Backward of the root module's outputs: the start of a backward."""
        if self.params is not None:
            self.params.root_backward()
        self._start_backward()
        scale = self._loss_scale()
        return grad if scale == 1.0 else grad * scale

    def _start_backward(self) -> None:
        if not self.state.in_backward:
            self.state.backward_started()
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    # ----------------------------------------------------------- gradient side
    def reduces_now(self) -> bool:
        """Whether this backward reduces: every synced backward at stages 2-3, the synced
        boundary backward at stages 0-1."""
        if not self.state.sync_enabled:
            return False
        return self.policy.reduce_every_backward or self.reducer.reduces_every_backward or self.state.is_boundary()

    def _make_hook(self, unit: Unit, flat, index: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            grad = param.grad
            param.grad = None
            if grad is None:
                return
            if self.forward_depth > 0 and not self.state.in_backward:
                # An autograd call inside forward (a tiled loss): accumulate only. Its
                # gradient never crossed the loss scale, so scale it here as the rest will be.
                scale = self._loss_scale()
                flat.grads.accumulate(index, grad if scale == 1.0 else grad * scale)
                unit.has_local_grad = True
                return
            flat.grads.accumulate(index, grad)
            unit.has_local_grad = True
            if not self.callback_queued:
                # The loss did not come through the root module's outputs (e.g. the model
                # was called piecewise): fall back to queuing from the first hook.
                self._start_backward()
            unit.mark_fired(index, flat)
            if unit.ready and self.reduces_now():
                self._reduce_ready_in_order()

        return hook

    def unit_inputs_reached(self, unit: Unit) -> None:
        """Stage 3's schedule: the backward computed the gradient of the unit's inputs."""
        if self.state.in_backward and unit.ready and self.reduces_now():
            self._reduce_ready_in_order()

    def _queue(self, unit: Unit) -> None:
        """Queue a unit's local gradients for reduction (a full bucket is reduced at once)."""
        for flat in unit.flats:
            self.reducer.add(flat)
        unit.has_local_grad = False

    def _reduce_ready_in_order(self) -> None:
        while self._next_in_order < len(self.reduce_order):
            unit = self.reduce_order[self._next_in_order]
            if not unit.ready:
                return
            self._queue(unit)
            if self.params is not None:
                self.params.unit_reduced(unit)
            self._next_in_order += 1

    def _finish(self) -> None:
        """End of a backward: the autograd engine has finished the outermost graph task."""
        self.run_epilogue()

    def run_epilogue(self) -> None:
        """Queue what is left, finish every reduction (or keep the gradients local), free
        stage 3's parameters. Also run by `engine.backward` when no hook fired, so this rank
        issues the same collectives as ranks whose loss did reach the model."""
        done = self.reduce_order[: self._next_in_order]
        pending = [u for u in done if u.has_local_grad]  # late gradients
        pending += self.reduce_order[self._next_in_order :]
        self.callback_queued = False
        self._next_in_order = 0
        for unit in self.units:
            unit.reset_readiness()
        reduces = self.reduces_now()
        self.state.backward_ended(reduced=reduces)
        if reduces:
            for unit in pending:
                self._queue(unit)
            self.reducer.finish()
            if self.views is not None and (not self.reducer.reduces_every_backward or self.state.is_boundary()):
                self.views.expose()
        if self.params is not None:
            self.params.free_all()

    def flush(self) -> None:
        """Reduce every unit's local gradient left by backward calls that did not reduce (a
        collective: same order on every rank)."""
        if not self.state.unreduced:
            return
        for unit in self.reduce_order:
            self._queue(unit)
        self.reducer.finish()
        self.state.flushed()
        if self.views is not None:
            self.views.expose()

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (local and reduced)."""
        if self.views is not None:
            self.views.clear()
        for unit in self.units:
            for flat in unit.flats:
                flat.grads.drop()
            unit.has_local_grad = False
        self.state.gradients_dropped()
        self.reducer.drop_accumulated()
        self.reducer.take_local_sum()  # dropped gradients name no rank
