"""Where gradient accumulation stands: one object the engine, its API and the gradient path share.

[Note: the accumulation state]
Between two optimizer steps a rank runs forwards and backwards; each backward either reduces
its gradients or keeps them local (no_sync, coalesce_grad_reduction, the non-boundary
micro-steps of stages 0-1), and `step()` steps the optimizer only at the accumulation boundary.
`Accumulation` holds every fact those decisions read, and changes them only through the named
methods below, so the order of a training loop reads in one place:

    STEPPED --forward--> FORWARD --backward--> BACKWARD --end--> LOCAL or REDUCED --step()--> STEPPED

`phase` is what happened last; `in_backward` is the phase BACKWARD. Facts that outlive a phase
stay beside it: `unreduced` (a backward left local gradients that `flush` must reduce before the
step; a later backward may still be running), `sync_enabled` (False inside no_sync() or a
coalesce_grad_reduction block) and the counters DeepSpeed's engine exposes (`micro_steps`,
`global_steps`, `skipped_steps`, `global_samples`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import Enum
from typing import Any


class Phase(Enum):
    STEPPED = "stepped"  # start, or step() ran: nothing happened since
    FORWARD = "forward"  # a forward ran (outside a backward)
    BACKWARD = "backward"  # a backward is running
    LOCAL = "local"  # the last backward kept its gradients local
    REDUCED = "reduced"  # the last backward (or a flush) reduced every local gradient


class Accumulation:
    """The accumulation state of one engine.

    Args:
        config: the engine's config; `gradient_accumulation_steps` and
            `managed_gradient_accumulation` are read when a boundary is decided.
    """

    def __init__(self, config: Any) -> None:
        self._config = config
        self.phase = Phase.STEPPED
        # DeepSpeed's counters (engine.micro_steps, ...: properties of the engine).
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self.backward_count = 0  # backward epilogues run so far
        # Outermost training forwards (grad enabled, train mode) since the last optimizer
        # step: every rank must run as many (checked with the step's norm, zeroshard/step/optimizer_step.py).
        self.training_forwards = 0
        self.forwards_since_backward = 0  # training forwards since the last backward ended
        self.unreduced = False  # local gradients a backward left for `flush`
        self.sync_enabled = True  # False inside no_sync() or coalesce_grad_reduction()
        self.in_coalesce = False
        self.step_applied = False  # the last step() changed the parameters
        # Set during a backward of a loss from `engine.scale`: already scaled (engine/api.py).
        self.prescaled = False
        self._in_step = False  # step() is running (the boundary when accumulation is unmanaged)
        self._coalesced = False  # a coalesce block ended: the next step() is the boundary
        self._boundary_override: bool | None = None
        self._stepped_after_backward = -1  # backward_count at the last step() call
        self._backwards_at_last_step = 0

    # --------------------------------------------------------------- boundary
    def is_boundary(self) -> bool:
        """Whether the current micro-step is the accumulation boundary."""
        config = self._config
        if not config.managed_gradient_accumulation:
            return self._in_step  # unmanaged: step() is the boundary
        if self._coalesced:
            return True  # the step after a coalesce_grad_reduction block
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % config.gradient_accumulation_steps == 0

    def override_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    # ------------------------------------------------------- forward, backward
    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    def forward_started(self, training: bool) -> None:
        """An outermost forward of the root module began (a recomputation inside a backward
        changes nothing)."""
        if self.in_backward:
            return
        self.phase = Phase.FORWARD
        if training:
            self.training_forwards += 1
            self.forwards_since_backward += 1

    def backward_started(self) -> None:
        self.phase = Phase.BACKWARD

    def backward_ended(self, reduced: bool) -> None:
        """A backward's epilogue ran; it reduced every local gradient, or kept them local."""
        self.backward_count += 1
        self.forwards_since_backward = 0
        self.phase = Phase.REDUCED if reduced else Phase.LOCAL
        self.unreduced = not reduced

    def flushed(self) -> None:
        """`flush` reduced what earlier backward calls left local."""
        self.unreduced = False
        if self.phase is Phase.LOCAL:
            self.phase = Phase.REDUCED

    def gradients_dropped(self) -> None:
        """zero_grad(): nothing is left to reduce."""
        self.unreduced = False

    def set_prescaled(self, value: bool) -> None:
        """A backward of a loss from `engine.scale` began (True) or its graph task ended."""
        self.prescaled = value

    def take_training_forwards(self) -> int:
        """The training forwards since the last optimizer step; the count starts again."""
        count, self.training_forwards = self.training_forwards, 0
        return count

    # ------------------------------------------------------------ sync blocks
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward calls inside keep their gradients local (no communication)."""
        previous = self.sync_enabled
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = previous

    @contextlib.contextmanager
    def coalescing(self) -> Iterator[None]:
        """The body of a coalesce_grad_reduction block: backward calls keep their gradients
        local. The caller reduces them after the block, then calls `coalesced`."""
        if not self.sync_enabled:
            raise RuntimeError("coalesce_grad_reduction() cannot be nested in no_sync() or in itself.")
        self.sync_enabled = False
        self.in_coalesce = True
        try:
            yield
        finally:
            self.sync_enabled = True
            self.in_coalesce = False

    def coalesced(self) -> None:
        """A coalesce block's sum was reduced: the next step() is the boundary."""
        self._coalesced = True

    # ------------------------------------------------------------------- step
    def begin_step(self) -> bool:
        """step() was called: False when it repeats the last call (no backward since), which
        then changes nothing; True otherwise, and step() is running until `end_step`."""
        if not self.sync_enabled:
            block = "coalesce_grad_reduction()" if self.in_coalesce else "no_sync()"
            raise RuntimeError(f"engine.step() inside {block}: leave the with-block first.")
        self.step_applied = False
        if self.backward_count == self._stepped_after_backward:
            return False
        self._stepped_after_backward = self.backward_count
        self._in_step = True
        return True

    def optimizer_ran(self, overflow: bool) -> None:
        """The boundary step ran the optimizer, or skipped it (a non-finite gradient)."""
        if overflow:
            self.skipped_steps += 1
        self.step_applied = not overflow

    def boundary_step_done(self, samples: int) -> None:
        """The boundary step is counted; `samples` is DeepSpeed's global_samples increment
        (`samples_since_last_step`)."""
        self.global_steps += 1
        self.global_samples += samples
        self._backwards_at_last_step = self.backward_count

    @property
    def backwards_this_step(self) -> int:
        """Backward calls since the last boundary step (the micro-step's index within the step)."""
        return self.backward_count - self._backwards_at_last_step

    def samples_since_last_step(self, train_batch_size: int, per_backward: int) -> int:
        """A train batch per step, or with unmanaged accumulation `per_backward` samples for
        every backward since the last boundary step."""
        if self._config.managed_gradient_accumulation:
            return train_batch_size
        return per_backward * (self.backward_count - self._backwards_at_last_step)

    def end_step(self) -> None:
        """step() is over (also when it raised)."""
        self._in_step = False
        self._coalesced = False

    def micro_step_done(self) -> None:
        self.micro_steps += 1
        self.phase = Phase.STEPPED
