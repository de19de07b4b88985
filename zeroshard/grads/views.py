"""`param.grad` after the boundary backward at stages 0 and 1: views into the reduced gradient.

DeepSpeed users read `param.grad` after the boundary backward (to log or inspect it). At
stages 0 and 1 the reduction is an all-reduce written back into the flat's full gradient
buffer (zeroshard/sharding/stages.py), so the reduced (averaged) gradient of every parameter exists
whole on every rank, and each parameter's `.grad` becomes a view of its region there: no
second copy. The optimizer reads the master's range of the same buffer (the whole of it at
stage 0, this rank's shard at stage 1), so changing `.grad` in place changes what the step
applies; at stage 1 each rank steps on its own shard, so a change must be made the same way
on every rank (as any code that runs on every rank does). `safe_set_full_grad` writes the whole
buffer (so the views show it); `safe_set_local_grad` writes this rank's part only, which at
stage 1 the other ranks' views do not see (the step and `safe_get_full_grad` read the shards).
The views exist from the end of the boundary backward until the step (or `zero_grad`, or the
next forward), so no later backward accumulates into the reduced buffer through them.

During accumulation (the micro-steps before the boundary, and inside `no_sync`) `.grad` is
None: each gradient moves into the flat's local buffer as autograd produces it, and the local
sum is not the gradient the step uses (it is not reduced). This is the same at every stage.

Not exposed (`.grad` stays None; `zeroshard.utils.safe_get_full_grad` reads it): at stages
2-3 (the reduced gradient is a shard: the whole one exists on no rank), where the buffer's
dtype is not the parameter's (bf16 parameters with fp32 accumulation: torch requires a
gradient of the parameter's dtype, and a cast would be a second copy), and while a loss scale
other than 1 is in force (the buffer holds the scaled gradient).
"""

from __future__ import annotations

from collections.abc import Callable

from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.stages import StagePolicy


class GradViews:
    """Puts and removes the `.grad` views of one engine's parameters."""

    def __init__(self, flats: list[FlatParamGroup], policy: StagePolicy, loss_scale: Callable[[], float]) -> None:
        self.flats = flats
        self.enabled = not policy.scatter and not policy.reduce_every_backward  # stages 0-1
        self._loss_scale = loss_scale
        self.exposed = False

    def expose(self) -> None:
        """After a reduction: `.grad` of each parameter views the reduced gradient."""
        if not self.enabled or self._loss_scale() != 1.0:
            return
        for flat in self.flats:
            reduced = flat.grads.reduced_full
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
