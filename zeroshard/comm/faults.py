"""What a rank reports when the ranks stop moving together: a collective that failed or
timed out, and ranks that disagree on where they are in training.

[Note: where a collective ran]
`where` is the engine's position, set as it goes (the step by the engine, the unit by the
unit being gathered or reduced), so that a collective's error names the step and the unit it
belonged to. zeroshard.comm captures it when a collective is issued, so an asynchronous
one (a prefetch, a gradient bucket) that fails later still names its own unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer stopped, died, or ran other collectives."""


class HangError(CollectiveError):
    """The ranks stopped moving together: a divergence (ranks in different collectives), a
    rank stuck outside zeroshard, or a dead or stopped rank. Raised on every rank the watchdog
    reaches (zeroshard/comm/watchdog.py): the message is what this rank was doing, then the
    diagnosis, the same text on every rank (`diagnosis`)."""

    def __init__(self, where: str, diagnosis: str) -> None:
        super().__init__(f"{where}\n{diagnosis}")
        self.diagnosis = diagnosis

    def __reduce__(self):
        first, _, _ = str(self).partition("\n")
        return (type(self), (first, self.diagnosis))


class RankDesyncError(RuntimeError):
    """The ranks disagree on their step or their number of training forwards in it."""


@dataclass
class Where:
    step: int | None = None
    unit: str | None = None
    phase: str | None = None  # forward, backward, reduction, optimizer step, save, load (memory/oom.py)

    def describe(self) -> str:
        parts = []
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.unit is not None:
            parts.append(f"unit '{self.unit}'")
        return ", ".join(parts) or "outside a training step"


where = Where()


@contextlib.contextmanager
def in_phase(name: str) -> Iterator[None]:
    """The engine is in phase `name` inside the block (an out-of-memory report names it)."""
    previous, where.phase = where.phase, name
    try:
        yield
    finally:
        where.phase = previous


@contextlib.contextmanager
def in_unit(name: str) -> Iterator[None]:
    """Collectives issued inside the block belong to unit `name`."""
    previous, where.unit = where.unit, name
    try:
        yield
    finally:
        where.unit = previous


def check_positions(ranks: tuple[int, ...], steps: list[float], forwards: list[float]) -> None:
    """Raise RankDesyncError on every rank when the ranks' step counters or their counts of
    training forwards since the last step differ (all ranks see the same lists)."""
    if len(set(steps)) <= 1 and len(set(forwards)) <= 1:
        return
    positions = ", ".join(
        f"rank {r} at step {int(s)} after {int(f)} training forward(s)"
        for r, s, f in zip(ranks, steps, forwards, strict=True)
    )
    raise RankDesyncError(
        f"ranks are out of step: {positions}. A rank skipped part of a training step (for example "
        "it caught an exception in forward or backward and carried on), so its gradients would be "
        "mixed with another step's. Every rank must run the same training forwards (grad enabled, "
        "train mode), backward and step calls; run one-rank-only evaluation under torch.no_grad() "
        "or engine.eval(). Stop and resume from the last checkpoint."
    )
