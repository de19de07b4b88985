"""`param.grad` after the boundary backward at stage 0: views into the reduced gradient.

DeepSpeed users read `param.grad` after the boundary backward (to log or inspect it). At
stage 0 the reduced (averaged) gradient of every parameter exists whole on every rank, in the
flat's gradient buffer, so each parameter's `.grad` becomes a view of its region there: no
second copy. Changing it in place changes what the step applies. The views exist from the
end of the boundary backward until the step (or `zero_grad`, or the next forward), so no
later backward accumulates into the reduced buffer through them.

Not exposed (`.grad` stays None; `zeroshard.utils.safe_get_full_grad` reads it): at stages
1-3 (the reduced gradient is a shard: the whole one exists on no rank), where the buffer's
dtype is not the parameter's (bf16 parameters with fp32 accumulation: torch requires a
gradient of the parameter's dtype, and a cast would be a second copy), and while a loss scale
other than 1 is in force (the buffer holds the scaled gradient).
"""

from __future__ import annotations

from collections.abc import Callable

from .flat import FlatParamGroup
from .stages import StagePolicy


class GradViews:
    """Puts and removes the `.grad` views of one engine's parameters."""

    def __init__(self, flats: list[FlatParamGroup], policy: StagePolicy, loss_scale: Callable[[], float]) -> None:
        self.flats = flats
        self.enabled = not policy.scatter and not policy.reduce_every_backward  # stage 0
        self._loss_scale = loss_scale
        self.exposed = False

    def expose(self) -> None:
        """After a reduction: `.grad` of each parameter views the reduced gradient."""
        if not self.enabled or self._loss_scale() != 1.0:
            return
        for flat in self.flats:
            reduced = flat.reduced_grad
            if reduced is None or reduced.dtype != flat.full.dtype or reduced.numel() != flat.padded_numel:
                continue
            for index, p in enumerate(flat.params):
                p.grad = flat.param_view(reduced, index)
        self.exposed = True

    def clear(self) -> None:
        """Before a forward, a step or zero_grad: drop the views."""
        if not self.exposed:
            return
        for flat in self.flats:
            for p in flat.params:
                p.grad = None
        self.exposed = False
