"""`wall_clock_breakdown`: where a step's time goes, with DeepSpeed's timer names.

    fwd            engine.forward (every micro-batch of the step)
    bwd            engine.backward
    bwd_inner      bwd less the reduction waited for inside it
    bwd_allreduce  the gradient reduction: issuing the last buckets and waiting for them all
    step           engine.step (optimizer, clipping, publishing; a reduction left by no_sync)
    gather         parameter all-gathers waited for: stage 3 in fwd and bwd, the stage 1-2
                   publish of updated parameters in step
    newton_schulz  Muon's Newton-Schulz orthogonalisation (inside step)

fwd + bwd + step is the engine's share of a step; bwd_inner + the part of bwd_allreduce inside
bwd is bwd; gather and newton_schulz are parts of the others, not addends.

[Note: no host synchronisation]
On a GPU each span is a pair of CUDA events recorded on the current stream, read (one
`synchronize` of the last event) only when the figures are asked for: at `steps_per_print` or
`summary()`. On a CPU a span is `time.perf_counter` around the work, which already ran.

Spans nest: the engine opens fwd/bwd/step (`span`), and code deeper down (the reducer, the
gatherer) opens `timed(name)`, which records into the engine span open around it and costs a
global read when none is.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

__all__ = ["StepTimers", "timed", "TIMER_NAMES", "MONITOR_NAMES"]

logger = logging.getLogger("zeroshard")

TIMER_NAMES = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step", "gather", "newton_schulz")
# DeepSpeed's monitor events for the timers (written with the samples seen as the x value).
MONITOR_NAMES = {
    "fwd": "Train/Samples/elapsed_time_ms_forward",
    "bwd": "Train/Samples/elapsed_time_ms_backward",
    "bwd_inner": "Train/Samples/elapsed_time_ms_backward_inner",
    "bwd_allreduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "step": "Train/Samples/elapsed_time_ms_step",
}

_NULL = contextlib.nullcontext()
_current: StepTimers | None = None  # the engine whose span is open


def timed(name: str) -> contextlib.AbstractContextManager:
    """A span of `name` inside the engine span now open; nothing when none is."""
    timers = _current
    return _NULL if timers is None else timers.span(name)


class StepTimers:
    """Per-step spans summed over an interval of optimizer steps.

    Args:
        device: where the work runs; CUDA gets events, anything else `perf_counter`.
        enabled: False makes every span a no-op (wall_clock_breakdown and flops_profiler off).
    """

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.enabled = enabled
        self._cuda = device.type == "cuda"
        self._open: list[str] = []
        # (name, enclosing engine span) -> durations not yet read: seconds or event pairs.
        self._pending: dict[tuple[str, str], list] = {}
        self._totals_ms: dict[tuple[str, str], float] = {}
        self._steps = 0
        self._last: dict[str, float] = {}

    # ------------------------------------------------------------- recording
    def _mark(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        global _current
        if not self.enabled:
            yield
            return
        parent = self._open[0] if self._open else ""
        outer, _current = _current, self
        self._open.append(name)
        start = self._mark()
        try:
            yield
        finally:
            end = self._mark()
            self._open.pop()
            _current = outer
            self._pending.setdefault((name, parent), []).append((start, end))

    def step_done(self) -> None:
        """An optimizer step ended: the spans since the last one belong to it."""
        if self.enabled:
            self._steps += 1

    def _read(self) -> None:
        for key, spans in self._pending.items():
            if self._cuda:
                for _, end in spans:  # spans may sit on different streams
                    end.synchronize()
            ms = sum(s.elapsed_time(e) if self._cuda else (e - s) * 1e3 for s, e in spans)
            self._totals_ms[key] = self._totals_ms.get(key, 0.0) + ms
        self._pending.clear()

    # --------------------------------------------------------------- reading
    def close_interval(self) -> dict[str, float]:
        """Mean milliseconds per optimizer step over the steps since the last call; starts
        the next interval. Keys: TIMER_NAMES and "steps"."""
        self._read()
        steps = max(self._steps, 1)
        totals = self._totals_ms

        def total(name: str, parent: str | None = None) -> float:
            return sum(v for (n, p), v in totals.items() if n == name and (parent is None or p == parent))

        out = {name: total(name) / steps for name in TIMER_NAMES if name != "bwd_inner"}
        out["bwd_inner"] = out["bwd"] - total("bwd_allreduce", "bwd") / steps
        out["steps"] = float(self._steps)
        self._totals_ms = {}
        self._steps = 0
        self._last = out
        return out

    def summary(self) -> dict[str, float]:
        """The last interval's figures (ms per step), as `timers/<name>_ms`; empty before the
        first interval closes."""
        return {f"timers/{k}_ms" if k != "steps" else "timers/steps": v for k, v in self._last.items()}

    def monitor_events(self, samples: int) -> list[tuple[str, float, int]]:
        """DeepSpeed's `Train/Samples/elapsed_time_ms_*` events for the last interval."""
        return [(event, self._last[name], samples) for name, event in MONITOR_NAMES.items() if name in self._last]

    def log_line(self) -> str:
        """DeepSpeed's timer line: `time (ms) | fwd: 1.23 | bwd: ...` (means per step)."""
        names = [n for n in TIMER_NAMES if n not in ("gather", "newton_schulz") or self._last.get(n)]
        return "time (ms)" + "".join(f" | {n}: {self._last[n]:.2f}" for n in names if n in self._last)
