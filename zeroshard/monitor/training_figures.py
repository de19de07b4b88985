"""What the engine knows after each optimizer step: DeepSpeed's monitor events and
`engine.metrics()`.

`TrainingFigures` is the engine's one contact with monitoring: `engine.backward` hands it the loss
(`note_loss`), the boundary step calls `after_step`. Other producers (MoE layers, timers)
register a function returning a dict of figures (`register`); `metrics()` merges theirs in
when asked. Device scalars (the loss, the gradient norm) are kept as tensors and read only
when `metrics()` is called or by the monitor's writer thread, so a step waits for neither.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from zeroshard.monitor.background import to_number
from zeroshard.monitor.events import step_events
from zeroshard.monitor.master import MonitorMaster

Producer = Callable[[], Mapping[str, Any]]


class TrainingFigures:
    """The latest step's figures on this rank, and the events rank 0 sends to the monitors."""

    def __init__(self, monitor: MonitorMaster, fp16: bool) -> None:
        self.monitor = monitor
        self._fp16 = fp16
        self._loss_sum: torch.Tensor | None = None  # this step's backward returns, summed
        self._latest: dict[str, Any] = {
            "loss": None, "lr": None, "loss_scale": None, "grad_norm": None, "samples": 0, "step": 0,
        }
        self._producers: dict[str, Producer] = {}

    def note_loss(self, returned: torch.Tensor) -> None:
        """One `engine.backward`'s returned loss (already divided by the accumulation steps)."""
        loss = returned.detach()
        if loss.numel() != 1:
            loss = loss.float().mean()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss

    def after_step(
        self, step: int, samples_before: int, samples_after: int, lr: list[float],
        loss_scale: float, grad_norm: torch.Tensor | None,
    ) -> None:
        """Record the boundary step that just ran (`step` counts it) and send its events."""
        loss, self._loss_sum = self._loss_sum, None
        first_lr = lr[0] if lr else None
        scale = loss_scale if self._fp16 else None
        self._latest = {
            "loss": loss, "lr": first_lr, "loss_scale": loss_scale, "grad_norm": grad_norm,
            "samples": samples_after, "step": step,
        }
        if self.monitor.writes:
            self.monitor.write_events(step_events(loss, samples_before, samples_after, first_lr, scale))

    def register(self, name: str, producer: Producer) -> None:
        """Add `producer()`'s figures to `metrics()` as `name/<key>`, or as `<key>` itself when
        `name` is "" (a producer whose keys are already unique, e.g. the engine's timers). A
        second call with the same name replaces the first."""
        self._producers[name] = producer

    def unregister(self, name: str) -> None:
        self._producers.pop(name, None)

    def metrics(self) -> dict[str, Any]:
        """The latest figures as plain Python numbers (None where not known yet)."""
        out = {key: (None if value is None else to_number(value)) for key, value in self._latest.items()}
        for name, producer in self._producers.items():
            for key, value in producer().items():
                out[f"{name}/{key}" if name else key] = value if value is None else to_number(value)
        return out
