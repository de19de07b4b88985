"""A unit: a module, its flat buffers, and its readiness within one backward."""

from __future__ import annotations

from torch import nn

from zeroshard.comm import faults
from zeroshard.sharding.flat import FlatParamGroup, ShardState


class Unit:
    """The parameters gathered, freed and reduced together (docs/design.md section 3)."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParamGroup]) -> None:
        self.name = name
        self.module = module
        self.flats = flats
        self.expected_hooks = sum(len(f.params) for f in flats)
        self._fired: set[tuple[int, int]] = set()
        # Stage 3: the unit's forward inputs that carry a gradient since the last backward, and
        # how many of those gradients the backward has computed (`inputs_reached`).
        self.inputs_expected = 0
        self.inputs_done = 0
        # Gradients accumulated locally since the unit was last reduced.
        self.has_local_grad = False
        # Stage 3: the unit's own module is running its forward (the schedule's hooks on its
        # submodules read it; a flag, not a set of ids, so that compiled blocks share a graph).
        self.forward_running = False

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.flats)

    @property
    def sharded_numel(self) -> int:
        """Elements gathered and freed at stage 3 (not the resident flats')."""
        return sum(f.numel for f in self.flats if f.params_sharded)

    @property
    def held_numel(self) -> int:
        """Elements whose full storage is held now (gathered or being gathered)."""
        return sum(f.numel for f in self.flats if f.full_held)

    # ---------------------------------------------------------- readiness
    def mark_fired(self, index: int, flat: FlatParamGroup) -> None:
        self._fired.add((id(flat), index))

    @property
    def complete(self) -> bool:
        """Every parameter's hook has fired in this backward."""
        return len(self._fired) >= self.expected_hooks

    @property
    def inputs_reached(self) -> bool:
        """The backward has computed the gradient of every forward input of the unit: its own
        backward is over, whichever of its parameters this rank used. Unlike `complete`, a
        point every rank reaches in the same order (zeroshard/sharding/schedule.py's note)."""
        return 0 < self.inputs_expected <= self.inputs_done

    @property
    def ready(self) -> bool:
        """The unit's gradient can be reduced: every hook fired, or its backward is over."""
        return self.complete or self.inputs_reached

    def reset_readiness(self) -> None:
        self._fired.clear()
        self.inputs_expected = 0
        self.inputs_done = 0

    # ------------------------------------------------------------ storage
    @property
    def gathered(self) -> bool:
        return all(f.state is ShardState.UNSHARDED for f in self.flats)

    def gather(self, tag: str = "param", exact: bool = False, readable: bool = False) -> None:
        """Materialise every flat's full parameters (`exact`: in the parameter dtype, not the
        plan's gather dtype; for readers such as exports, not for compute). `readable`: the
        parameters hold values afterwards (a flat gathered in fp8 for compute holds
        placeholders, zeroshard/sharding/fp8_gather.py's note, so it is gathered exactly)."""
        with faults.in_unit(self.name):
            for flat in self.flats:
                flat.gather_full(tag, exact or (readable and flat.fp8 is not None))

    def start_gather(self) -> None:
        with faults.in_unit(self.name):
            for flat in self.flats:
                flat.start_gather()

    def free(self) -> None:
        for flat in self.flats:
            flat.free_full()

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, params={self.expected_hooks}, numel={self.numel})"
