"""Stage 3's parameter schedule: when each unit's full parameters are gathered and freed.

A unit's parameters exist only around its forward and its backward (DESIGN section 3):

* forward: gathered by the unit's forward pre-hook, freed by its forward hook (the root unit
  stays gathered for the whole forward: its parameters may be used anywhere);
* backward: gathered when the gradient reaches the unit's outputs, freed once the gradient
  path has queued its gradient for reduction (`unit_reduced`), and at the end of every
  backward whatever is left;
* prefetch: while a unit computes, the units that follow it in the last forward's order (or
  precede it, going backwards) start gathering: always the next one, even when it alone
  exceeds `stage3_prefetch_bucket_size` (a 1B+ transformer block does, and never
  prefetching would expose every gather), then more while they fit in that many elements;
* a forward inside a backward is an activation checkpoint's recomputation: its parameters
  stay gathered for the backward that follows, and it prefetches in backward order.

[Note: reductions in the same order on every rank]
At stage 3 the gradient reductions share the shard group with the backward all-gathers, so
every rank must issue both in the same order: a reduce-scatter paired with another rank's
all-gather hangs (NCCL, gloo) or corrupts. A unit used differently by each rank (a
data-dependent branch, an expert with no tokens) completes its parameter hooks on some ranks
and not on others; reducing "when every hook fired" then puts its reduce-scatters among the
all-gathers at different places. So a unit's forward inputs pass through an identity whose
backward says "this unit's backward is over" (`Unit.inputs_reached`): every rank runs the
unit and reaches that point, in backward order, between the same all-gathers; the gradient
path reduces the unit there (its unused parameters reduce zeros), or earlier if every hook
fired already (autograd runs a parameter's gradient accumulation as soon as it is ready, so
that too is before the inputs' gradient, between the same all-gathers). A unit whose inputs
carry no gradient (token ids) keeps the old rule; so does any unit after a forward with
gradients on that no backward followed (its counts are off until the next backward ends).

The root module's hooks belong to the gradient path (zeroshard/grad_path.py), which calls
`root_pre_forward`, `root_post_forward` and `root_backward` here; this class installs the
hooks of the other units itself. At stages 0-2 there is no schedule (parameters stay whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .grad_path import EngineHook, wrap_outputs
from .unit import Unit


class ParamSchedule:
    """Gathers, prefetches and frees stage-3 units.

    Args:
        units: the engine's units, root first.
        prefetch_numel: stage3_prefetch_bucket_size (elements gathered ahead).
        in_backward: whether a backward is running now (the gradient path knows).
        inputs_reached: called when a backward has computed the gradient of every forward
            input of a unit (the gradient path reduces it: see the note above).
    """

    def __init__(
        self,
        units: list[Unit],
        prefetch_numel: int,
        in_backward: Callable[[], bool],
        inputs_reached: Callable[[Unit], None] | None = None,
    ) -> None:
        self.units = units
        self.root = units[0]
        self.prefetch_numel = prefetch_numel
        self._in_backward = in_backward
        self._inputs_reached = inputs_reached or (lambda unit: None)
        self._order_now: list[Unit] = []  # units in the order the running forward used them
        self._forward_order: list[Unit] = []  # the last complete forward's order
        self._position: dict[int, int] = {}
        self._handles: list[Any] = []
        self._running: set[int] = set()  # ids of the units whose own module's forward is running
        for unit in units[1:]:
            self._handles.append(unit.module.register_forward_pre_hook(EngineHook(self._unit_pre(unit))))
            self._handles.append(unit.module.register_forward_hook(EngineHook(self._unit_post(unit)), always_call=True))
            for module in unit.module.modules():
                if module is not unit.module and module._parameters:
                    self._handles.append(module.register_forward_pre_hook(EngineHook(self._part_pre(unit))))
                    self._handles.append(module.register_forward_hook(EngineHook(self._part_post(unit))))
        for unit in units:
            within = {id(m) for m in unit.module.modules()}
            covered = [u for u in units if id(u.module) in within]  # the root's: every unit
            refuse = EngineHook(self._refuse_sharded_state_dict(covered))
            self._handles.append(unit.module.register_state_dict_pre_hook(refuse))

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
            self._running.add(id(unit))
            unit.gather()
            if self._in_backward():
                self._prefetch(unit, -1)  # a checkpoint's recomputation: backward order
                return None
            self._order_now.append(unit)
            self._prefetch(unit, +1)
            if not torch.is_grad_enabled():
                return None
            return self._mark_inputs(unit, args)

        return pre

    def _mark_inputs(self, unit: Unit, args: tuple) -> tuple:
        def on_input_grad(grad):
            unit.inputs_done += 1
            if unit.inputs_reached:
                self._inputs_reached(unit)
            return grad

        wrapped = wrap_outputs(args, on_input_grad)
        unit.inputs_expected += sum(a is not b for a, b in zip(tree_leaves(wrapped), tree_leaves(args), strict=True))
        return wrapped

    def _unit_post(self, unit: Unit):
        def post(module, args, output):
            self._running.discard(id(unit))
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

    @staticmethod
    def _refuse_sharded_state_dict(covered: list[Unit]):
        """`state_dict()` of a module whose units are freed would hold empty tensors (a file
        of them cannot be loaded back): refuse, saying how to get the full values.
        keep_vars=True (the parameters themselves, e.g. to list the keys) is allowed."""

        def hook(module, prefix, keep_vars) -> None:
            if keep_vars:
                return
            sharded = [u.name for u in covered if not u.gathered]
            if not sharded:
                return
            raise RuntimeError(
                f"state_dict() at ZeRO stage 3: the parameters of unit(s) {sharded[:3]} are sharded "
                "(empty outside a gather), so it would hold empty tensors. Save with "
                "engine.save_16bit_model(dir) or engine.save_checkpoint(dir), or call it inside "
                "`with zeroshard.zero.GatheredParameters(engine.module.parameters()):` on every rank "
                "(a collective) and clone what you keep."
            )

        return hook

    # [Note: a unit's submodules called on their own]
    # A model may call a unit's submodules without calling the unit (a ModuleList of
    # ModuleDicts whose forward calls block["norm"], or block.fc(x) from the root). Every
    # submodule owning parameters gathers its unit when it runs outside the unit's own
    # forward; the unit then stays gathered until the root forward ends (free_all), and the
    # submodule's outputs gather it again when the gradient reaches them in backward.
    def _part_pre(self, unit: Unit):
        def pre(module, args):
            if id(unit) not in self._running:
                unit.gather()

        return pre

    def _part_post(self, unit: Unit):
        def on_grad(grad):
            unit.gather()
            return grad

        def post(module, args, output):
            if id(unit) in self._running:
                return None
            return wrap_outputs(output, on_grad)

        return post

    def _prefetch(self, unit: Unit, direction: int) -> None:
        """Start gathering the units that follow `unit` in the last forward's order (or
        precede it, going backwards): the next one always, then more up to `prefetch_numel`
        elements in all (FSDP2 and DeepSpeed likewise never leave the next unit unstarted)."""
        position = self._position.get(id(unit))
        if position is None:
            return
        budget = self.prefetch_numel
        j = position + direction
        while 0 <= j < len(self._forward_order):
            nxt = self._forward_order[j]
            if nxt.numel > budget and j != position + direction:
                return
            budget -= nxt.numel
            nxt.start_gather()
            j += direction

