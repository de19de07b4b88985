"""Stage 3's parameter schedule: when each unit's full parameters are gathered and freed.

A unit's parameters exist only around its forward and its backward (docs/design.md section 3):

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
  stay gathered for the backward that follows, and it prefetches in backward order;
* DeepSpeed's caps: a unit whose next use (in the last forward's order: the rest of that
  forward, then the backward down to the unit) comes within `stage3_max_reuse_distance`
  elements (strictly: 0 keeps nothing) stays gathered from its forward to its backward
  instead of being freed and gathered again; `stage3_max_live_parameters` bounds the elements
  that prefetching and keeping for reuse hold gathered (the gather a unit needs to run is
  never refused, so the peak is at most the cap plus the root's and one unit's elements).

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

[Note: pinned units]
A unit whose parameter is used directly (zeroshard/sharding/direct_use.py's note) is pinned: gathered at
the use and kept gathered, whatever its own hooks or its reduction would free, until the end
of the backward that follows (`free_all` at the epilogue), or the end of the forward when no
output of it requires grad (no backward can follow: evaluation, `torch.no_grad()`). Keeping it
is what makes the use safe in backward, where nothing watches the parameters: an op's saved views of
the parameter, an activation checkpoint's recomputation (reentrant checkpointing runs the
forward under no_grad, so grad mode cannot decide the pin), an in-place op. The outputs of a
direct use also gather and pin the unit when the gradient reaches them, for a second backward
through a retained graph. The cost: such a unit stays materialised from its use to the end of
the backward. `step()` releases every pin (a gathered copy is stale after the update).

The root module's hooks belong to the gradient path (zeroshard/grads/path.py), which calls
`root_pre_forward`, `root_post_forward` and `root_backward` here; this class installs the
hooks of the other units itself. At stages 0-2 there is no schedule (parameters stay whole).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from zeroshard.sharding.direct_use import DirectUseMode, param_finder
from zeroshard.sharding.hooks import EngineHook, call_eagerly, wrap_outputs
from zeroshard.sharding.unit import Unit


class ParamSchedule:
    """Gathers, prefetches and frees stage-3 units.

    Args:
        units: the engine's units, root first.
        prefetch_numel: stage3_prefetch_bucket_size (elements gathered ahead).
        max_live_numel: stage3_max_live_parameters (see the caps above).
        reuse_numel: stage3_max_reuse_distance (0: free every unit after each use).
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
        max_live_numel: int = 1_000_000_000,
        reuse_numel: int = 0,
    ) -> None:
        self.units = units
        self.root = units[0]
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.reuse_numel = reuse_numel
        self._reuse_distance: dict[int, int] = {}  # unit id -> elements until its next use
        self._kept: dict[int, Unit] = {}  # kept gathered from the forward for its backward
        # Counting what is held walks every flat: only when the cap can bind (a cap at least the
        # model's size never does), or when a test or benchmark asks for the peak.
        self._cap_binds = max_live_numel < sum(unit.sharded_numel for unit in units)
        self.track_peak = False
        self.peak_held_numel = 0  # the most elements held gathered at once, with track_peak
        self._in_backward = in_backward
        self._inputs_reached = inputs_reached or (lambda unit: None)
        self._order_now: list[Unit] = []  # units in the order the running forward used them
        self._forward_order: list[Unit] = []  # the last complete forward's order
        self._position: dict[int, int] = {}
        self._handles: list[Any] = []
        self._parts_running: dict[int, int] = {}  # unit id -> its submodules' forwards running
        self._pinned: dict[int, Unit] = {}  # see [Note: pinned units]
        self._pinned_now: list[Unit] = []  # pinned by the running outermost forward
        for unit in units[1:]:
            self._handles.append(unit.module.register_forward_pre_hook(EngineHook(self._unit_pre(unit))))
            self._handles.append(unit.module.register_forward_hook(EngineHook(self._unit_post(unit)), always_call=True))
            for module in unit.module.modules():
                if module is not unit.module and module._parameters:
                    # Traceable hooks (the note on submodules below); not `always_call`: dynamo guards
                    # on such a hook's id, one graph per block (a raise is cleaned up by the next
                    # root forward instead).
                    pre, post = EngineHook(self._part_pre(unit), True), EngineHook(self._part_post(unit), True)
                    self._handles.append(module.register_forward_pre_hook(pre))
                    self._handles.append(module.register_forward_hook(post))
        # Parameters of the units that are gathered and freed (not the root's, not resident ones).
        self._watched: dict[int, list[torch.nn.Parameter]] = {}  # unit id -> its parameters the mode watches
        owner = {}
        for unit in units[1:]:
            for flat in unit.flats:
                if not flat.policy.keep_full_params:
                    self._watched.setdefault(id(unit), []).extend(flat.params)
                    owner.update((id(p), unit) for p in flat.params)
        self._mode = (
            DirectUseMode(param_finder(owner, self._outside), self._use_directly, self._wrap_direct_output)
            if owner else None
        )
        self._armed: DirectUseMode | None = None  # the mode armed by the running root forward
        for unit in units:
            within = {id(m) for m in unit.module.modules()}
            covered = [u for u in units if id(u.module) in within]  # the root's: every unit
            refuse = EngineHook(self._refuse_sharded_state_dict(covered))
            self._handles.append(unit.module.register_state_dict_pre_hook(refuse))

    def remove(self) -> None:
        self._disarm()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -------------------------------------------------------------- root module
    def root_pre_forward(self, outermost: bool) -> None:
        if outermost:
            for unit in self.units:
                unit.forward_running = False  # left over if a forward raised
            self._parts_running.clear()
            if not self._in_backward():
                self._order_now = []
                self._pinned_now = []
            self._disarm()  # armed still if a forward raised before its root hook could end it
            if self._mode is not None:
                self._mode.arm()
                self._armed = self._mode
                for unit in self.units[1:]:
                    self._rewatch(unit)
        self.root.gather()

    def root_post_forward(self, outermost: bool, backward_may_follow: bool) -> None:
        """`backward_may_follow`: some output of the forward requires grad."""
        if not outermost:
            return
        self._disarm()
        if not self._in_backward():
            if self._order_now:
                self._forward_order = list(self._order_now)
                self._position = {id(u): i for i, u in enumerate(self._forward_order)}
                self._reuse_distance = self._distances(self._forward_order)
            if not backward_may_follow:
                for unit in self._pinned_now:
                    self._pinned.pop(id(unit), None)
                self._kept.clear()
            self._pinned_now = []
            self.free_all(keep_pinned=True)  # including prefetched units the forward did not reach

    def root_backward(self) -> None:
        self.root.gather()

    # ----------------------------------------------------------- gradient path
    def unit_reduced(self, unit: Unit) -> None:
        """The unit's gradient is queued for reduction: its parameters are not needed until
        the next forward (the root unit's may still be, by any later unit's backward)."""
        self._kept.pop(id(unit), None)
        if unit is not self.root and id(unit) not in self._pinned:
            unit.free()

    def free_all(self, keep_pinned: bool = False) -> None:
        """Free every unit (a no-op for resident ones); without `keep_pinned`, the end of a
        backward (or a step), release every pin and every unit kept for reuse first."""
        if not keep_pinned:
            self._pinned.clear()
            self._kept.clear()
        for unit in self.units:
            if id(unit) not in self._pinned and id(unit) not in self._kept:
                unit.free()

    # ------------------------------------------------------------------ caps
    @staticmethod
    def _distances(order: list[Unit]) -> dict[int, int]:
        """Elements gathered between a unit's (last) forward use and its backward: the units
        after it in the forward, then the same units again in the backward."""
        distances, after = {}, 0
        for unit in reversed(order):
            distances.setdefault(id(unit), 2 * after)
            after += unit.sharded_numel
        return distances

    def _held_numel(self) -> int:
        held = sum(unit.held_numel for unit in self.units)
        self.peak_held_numel = max(self.peak_held_numel, held)
        return held

    def _keep_for_reuse(self, unit: Unit) -> bool:
        """Keep the unit gathered from its forward to its backward (see the caps above)."""
        distance = self._reuse_distance.get(id(unit))
        return (
            # Strictly within, as DeepSpeed counts: a distance of 0 keeps nothing.
            distance is not None and distance < self.reuse_numel and torch.is_grad_enabled()
            and (not self._cap_binds or self._held_numel() <= self.max_live_numel)
        )

    # ------------------------------------------------------------ direct use
    def _outside(self, unit: Unit) -> bool:
        """Neither the unit's module nor one of its submodules is running its forward."""
        return not unit.forward_running and not self._parts_running.get(id(unit))

    def _rewatch(self, unit: Unit) -> None:
        """Watch the unit's parameters while the mode is armed and the unit is `_outside`
        (direct_use.py's note): call it whenever either changes."""
        if self._armed is not None and id(unit) in self._watched:
            self._armed.watch(self._watched[id(unit)], self._outside(unit))

    def _disarm(self) -> None:
        mode, self._armed = self._armed, None
        if mode is not None:
            mode.disarm()
            for params in self._watched.values():
                mode.watch(params, False)

    def _use_directly(self, units: list[Unit]) -> None:
        """A parameter of each unit is about to be read by code outside it: gather and pin."""
        for unit in units:
            unit.gather(readable=True)  # a collective: every rank uses the parameter (docs/reliability.md)
            if id(unit) not in self._pinned:
                self._pinned[id(unit)] = unit
                self._pinned_now.append(unit)

    def _wrap_direct_output(self, output: Any, units: list[Unit]) -> Any:
        def on_grad(grad):
            # A backward through a retained graph after the first one released the pin.
            for unit in units:
                unit.gather(readable=True)
                self._pinned[id(unit)] = unit
            return grad

        return wrap_outputs(output, on_grad)

    # ------------------------------------------------------------ other units
    def _unit_pre(self, unit: Unit):
        def pre(module, args):
            unit.forward_running = True
            self._rewatch(unit)
            unit.gather()
            if self.track_peak:
                self._held_numel()
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
            unit.forward_running = False
            self._rewatch(unit)
            # During a backward the forward is a checkpoint's recomputation: the backward
            # that follows needs the parameters, so they are freed after it instead.
            if not self._in_backward() and id(unit) not in self._pinned:
                if self._keep_for_reuse(unit):
                    self._kept[id(unit)] = unit
                else:
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
    #
    # These hooks run inside the unit's forward too, so a compiled unit traces them
    # (EngineHook's `traceable`): there they read one flag of the unit, which dynamo guards on
    # by value, the same for every block (a set of unit ids would put each block's id into
    # its guards, one graph per block), and do nothing. Outside the unit's forward the work
    # runs eagerly.
    def _part_pre(self, unit: Unit):
        def outside(module, args):
            self._parts_running[id(unit)] = self._parts_running.get(id(unit), 0) + 1
            self._rewatch(unit)
            unit.gather()

        def pre(module, args):
            if not unit.forward_running:
                call_eagerly(outside, module, args)

        return pre

    def _part_post(self, unit: Unit):
        def on_grad(grad):
            unit.gather()
            return grad

        def outside(module, args, output):
            self._parts_running[id(unit)] = max(0, self._parts_running.get(id(unit), 0) - 1)
            self._rewatch(unit)
            return wrap_outputs(output, on_grad)

        def post(module, args, output):
            if unit.forward_running:
                return None
            return call_eagerly(outside, module, args, output)

        return post

    def _prefetch(self, unit: Unit, direction: int) -> None:
        self._start_prefetches(unit, direction)
        if self.track_peak:
            self._held_numel()

    def _start_prefetches(self, unit: Unit, direction: int) -> None:
        """Start gathering the units that follow `unit` in the last forward's order (or
        precede it, going backwards): the next one always, then more up to `prefetch_numel`
        elements in all (FSDP2 and DeepSpeed likewise never leave the next unit unstarted)."""
        position = self._position.get(id(unit))
        if position is None:
            return
        budget = self.prefetch_numel
        # stage3_max_live_parameters: never exceeded (None: the cap cannot bind).
        room = self.max_live_numel - self._held_numel() if self._cap_binds else None
        j = position + direction
        while 0 <= j < len(self._forward_order):
            nxt = self._forward_order[j]
            if nxt.numel > budget and j != position + direction:
                return
            if room is not None:
                missing = nxt.sharded_numel - nxt.held_numel
                if missing > room:
                    return
                room -= missing
            budget -= nxt.numel
            nxt.start_gather()
            j += direction

