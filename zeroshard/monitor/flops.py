"""`flops_profiler`: the model's FLOPs per step and the model FLOPs utilisation (MFU).

At `profile_step` (DeepSpeed's meaning: the step that starts with `global_steps ==
profile_step`) every forward and backward runs under torch's `FlopCounterMode`, which counts
the FLOPs of matmuls, linear layers, convolutions and attention (SDPA) from their shapes
(embedding lookups and elementwise ops count zero: the estimate covers the layers that
dominate). Counting slows that step down, so the next step is the one timed: its wall time
from the first forward to the end of `step()`. MFU = FLOPs / that time / peak, with the peak
`zeroshard.peak_tflops` (DeepSpeed's flops_profiler has no key for a peak) or, unset, the rate
of a square matmul measured on this device in the parameter dtype.

The figures are per rank (each rank counts the FLOPs of its own micro-batches).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["FlopsProfiler", "measure_matmul_tflops"]

logger = logging.getLogger("zeroshard")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None, repeats: int = 5) -> float:
    """TFLOP/s of an n x n by n x n matmul here (the best of `repeats`, after a warm-up).

    The best rather than the mean: a matmul's rate is capped by the hardware, and slower runs
    measure whatever else shared the device.
    """
    n = n or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


class FlopsProfiler:
    """Counts one step's FLOPs and times the next (see the module note).

    Args:
        section: the config's `flops_profiler` dict (None: off). Read: `enabled`,
            `profile_step` (default 1) and `recompute_fwd_factor` (the share of the forward
            recomputed by activation checkpointing, added to the count as DeepSpeed does).
        peak_tflops: the device's peak (None: measure a matmul when first needed).
        device, dtype: where and in what the model computes.
    """

    def __init__(self, section: dict[str, Any] | None, peak_tflops: float | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        section = section or {}
        self.enabled = bool(section.get("enabled", False))
        self.profile_step = int(section.get("profile_step", 1))
        self.recompute_fwd_factor = float(section.get("recompute_fwd_factor", 0.0))
        self.peak_tflops = peak_tflops
        self.peak_source = "zeroshard.peak_tflops" if peak_tflops is not None else "measured matmul"
        self.device, self.dtype = device, dtype
        self._counter: FlopCounterMode | None = None
        self._fwd_flops = 0
        self._forward_from = 0
        self.fwd_flops = 0
        self._timing_from: float | None = None
        self.flops_per_step: int | None = None
        self._last: dict[str, float] = {}

    # --------------------------------------------------------------- engine hooks
    def before_forward(self, global_steps: int) -> None:
        if not self.enabled:
            return
        if global_steps == self.profile_step and self._counter is None and self.flops_per_step is None:
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        if self._counter is not None:
            self._forward_from = self._counter.get_total_flops()
        elif global_steps == self.profile_step + 1 and self._timing_from is None and self.flops_per_step:
            _sync(self.device)
            self._timing_from = time.perf_counter()

    def after_forward(self) -> None:
        if self._counter is not None:
            self._fwd_flops += self._counter.get_total_flops() - self._forward_from

    def after_step(self) -> str | None:
        """Close the count or the timing; returns the line to log when the figures are ready."""
        if self._counter is not None:
            counter, self._counter = self._counter, None
            counter.__exit__(None, None, None)
            # Activation checkpointing recomputes that share of the forward in the backward.
            self.flops_per_step = int(counter.get_total_flops() + self.recompute_fwd_factor * self._fwd_flops)
            self.fwd_flops = self._fwd_flops
            return None
        if self._timing_from is not None and not self._last:
            _sync(self.device)
            seconds = time.perf_counter() - self._timing_from
            if self.peak_tflops is None:
                self.peak_tflops = measure_matmul_tflops(self.device, self.dtype)
            achieved = self.flops_per_step / seconds / 1e12
            self._last = {
                "flops/flops_per_step": float(self.flops_per_step),
                "flops/forward_flops": float(self.fwd_flops),
                "flops/step_time_ms": seconds * 1e3,
                "flops/achieved_tflops": achieved,
                "flops/peak_tflops": self.peak_tflops,
                "flops/mfu": achieved / self.peak_tflops,
            }
            return (
                f"flops profiler: {self.flops_per_step / 1e9:.3f} GFLOPs per step on this rank, step "
                f"{seconds * 1e3:.1f} ms, {achieved:.3f} TFLOPS achieved, MFU {achieved / self.peak_tflops:.1%} "
                f"of {self.peak_tflops:.3f} TFLOPS ({self.peak_source})"
            )
        return None

    def summary(self) -> dict[str, float]:
        return dict(self._last)
