"""The engine's figures in one place: the timers, the FLOPs profiler, the collective summary
and the MoE figures, each from its config key, closed and logged (rank 0) every
`steps_per_print` optimizer steps.

Muon's Newton-Schulz time is on whenever Muon steps, and the MoE figures (with the token
exchange's all-to-all time) whenever the model has MoE layers.

`summary()` is every figure of the last interval as one flat dict (for `engine.metrics()` and
users' own loggers); `monitor_events(samples)` the same as DeepSpeed-style monitor events.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.comm import collectives
from zeroshard.monitor.comms import CommsLogger
from zeroshard.monitor.flops import FlopsProfiler
from zeroshard.monitor.moe_figures import MoEFigures
from zeroshard.monitor.timers import StepTimers

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig

__all__ = ["RunFigures"]

logger = logging.getLogger("zeroshard")


class RunFigures:
    def __init__(
        self, model: nn.Module, config: ZeroshardConfig, device: torch.device, rank: int, optimizer: Any = None
    ) -> None:
        self.rank = rank
        self.steps_per_print = config.steps_per_print
        self.wall_clock_breakdown = config.wall_clock_breakdown
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.flops = FlopsProfiler(config.flops_profiler, config.zeroshard.peak_tflops, device, dtype)
        # Muon's figure (the Newton-Schulz time) is on whenever Muon steps.
        self.muon = "muon" in type(optimizer).__name__.lower()
        # DeepSpeed runs its global timers when either key is on; so do we.
        self.timers = StepTimers(device, config.wall_clock_breakdown or self.flops.enabled or self.muon)
        self.comms = CommsLogger(config.comms_logger)
        if self.comms.enabled:
            collectives._active_logs.append(self.comms)
        self.moe = MoEFigures(model)
        # The MoE token exchange's time: from the comms logger, or without it from a timed
        # recording of the all-to-alls alone.
        self._exchange = self.comms
        if self.moe.expert_parallel and not self.comms.enabled:
            self._exchange = CommsLogger({"enabled": True, "prof_all": False, "prof_ops": ["all_to_all"]})
            collectives._active_logs.append(self._exchange)
        # The process-wide recorder holds the logs: an engine dropped without destroy() must
        # not leave them there, growing with every later engine's collectives.
        self._detach = weakref.finalize(self, _detach, [self.comms, self._exchange])

    # ------------------------------------------------------------- engine hooks
    def before_forward(self, global_steps: int) -> None:
        self.flops.before_forward(global_steps)

    def after_forward(self) -> None:
        self.flops.after_forward()

    def after_step(self, engine: Any) -> None:
        """An optimizer step ended (global_steps moved)."""
        self.timers.step_done()
        self.moe.step_done()
        line = self.flops.after_step()
        if line is not None and self.rank == 0:
            logger.info(line)
        if engine.global_steps % self.steps_per_print == 0:
            self.close_interval()

    def close_interval(self) -> None:
        """Read the interval's figures (one host read each) and log them on rank 0."""
        lines: list[str] = []
        if self.timers.enabled:
            self.timers.close_interval()
            if self.wall_clock_breakdown:
                lines.append(self.timers.log_line())
        if self.comms.enabled:
            self.comms.close_interval()
            lines += self.comms.log_lines()
        if self.moe.enabled:
            if self._exchange is not self.comms:
                self._exchange.close_interval()
            self.moe.close_interval(self._exchange.time_ms("all_to_all"))
            lines += self.moe.log_lines()
        if self.rank == 0:
            for line in lines:
                logger.info(line)

    # ------------------------------------------------------------------ reading
    def summary(self) -> dict[str, float]:
        """Every figure of the last closed interval, flat (`timers/...`, `flops/...`,
        `comms/...`, `moe/...`); plain floats."""
        out: dict[str, float] = {}
        timers = self.timers.summary()
        if self.wall_clock_breakdown:
            out.update(timers)
        if self.muon and "timers/newton_schulz_ms" in timers:
            out["muon/newton_schulz_ms"] = timers["timers/newton_schulz_ms"]
        out.update(self.flops.summary())
        out.update(self.comms.summary())
        out.update(self.moe.summary())
        return out

    def monitor_events(self, samples: int) -> list[tuple[str, float, int]]:
        """The figures as monitor events `(name, value, samples)`: DeepSpeed's
        `Train/Samples/elapsed_time_ms_*` for the timers, `Train/<figure>` for the rest."""
        events = self.timers.monitor_events(samples) if self.wall_clock_breakdown else []
        for key, value in self.summary().items():
            if not key.startswith("timers/"):
                events.append((f"Train/{key.replace('moe/', 'MoE/', 1)}", value, samples))
        return events

    def close(self) -> None:
        self._detach()
        self.moe.remove()


def _detach(logs: list[CommsLogger]) -> None:
    for log in logs:
        while log in collectives._active_logs:
            collectives._active_logs.remove(log)
