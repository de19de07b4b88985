"""When it runs out anyway: the out-of-memory error re-raised with where and how much.

The engine runs its forward, backward, step, save and load inside `phase(...)`; an out-of-memory
error inside (torch's `OutOfMemoryError` on an accelerator, the CPU allocator's "can't allocate
memory") is re-raised as `ZeroshardOutOfMemoryError`, a subclass of `torch.OutOfMemoryError`
(so `except torch.OutOfMemoryError` still catches it), naming the phase (forward of which unit,
backward, reduction, optimizer step, save, load), the rank, the predicted peak (when the budget
check ran) and the actual peak (`torch.cuda.max_memory_allocated`; on the CPU the process's
resident peak). On CUDA, while the check is on, the allocator records its history
(`torch.cuda.memory._record_memory_history`) and the snapshot is dumped next to the run
(`zeroshard_oom_rank<R>.pickle` in the working directory; open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from zeroshard.comm import faults
from zeroshard.memory.budget import human_bytes

__all__ = ["ZeroshardOutOfMemoryError", "is_out_of_memory", "out_of_memory_report"]

CPU_OOM_TEXT = ("can't allocate memory", "out of memory")
SNAPSHOT_ENTRIES = 100_000


class ZeroshardOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory, with the phase, the rank, the predicted and actual peaks in the message."""


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, ZeroshardOutOfMemoryError):
        return False  # already reported by an enclosing phase
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in CPU_OOM_TEXT)


def start_recording(device: torch.device) -> bool:
    """Record CUDA allocations for the snapshot an out-of-memory error dumps (CUDA only)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
    return True


def _actual_peak(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return f"{human_bytes(torch.cuda.max_memory_allocated(device))} allocated at most"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return f"{human_bytes(rss)} resident at most (the process, on the host)"


def _snapshot(device: torch.device, rank: int, recording: bool) -> str:
    if not recording:
        return ""
    path = Path(os.getcwd()) / f"zeroshard_oom_rank{rank}.pickle"
    try:
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception as exc:  # noqa: BLE001 - the report must not hide the out-of-memory error
        return f" Writing the memory snapshot failed: {exc}."
    return f" Memory snapshot: {path} (open it at https://pytorch.org/memory_viz)."


def describe_phase(phase: str) -> str:
    unit = faults.where.unit
    if phase == "forward" and unit:
        return f"forward of unit '{unit}'"
    if phase == "reduction" and unit:
        return f"reduction of unit '{unit}'"
    return phase


@contextlib.contextmanager
def out_of_memory_report(phase: str, rank: int, device: torch.device, prediction: Callable[[], dict | None],
                         recording: bool = False) -> Iterator[None]:
    """Run a phase; re-raise an out-of-memory error inside it with the report (see the module).
    `prediction()`: the latest prediction's dict (plan.py), read when the error happens."""
    previous, faults.where.phase = faults.where.phase, phase
    unit = faults.where.unit  # the forward's unit hooks set it: put back after the phase
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        where = describe_phase(faults.where.phase or phase)
        step = f" at step {faults.where.step}" if faults.where.step is not None else ""
        predicted = prediction()
        if predicted:
            this = predicted["phase_peaks"].get(phase.split()[0])
            guess = (f"predicted peak {human_bytes(predicted['device_peak_bytes'])} (in {predicted['peak_phase']}"
                     + (f"; this phase {human_bytes(this)})" if this is not None else ")"))
        else:
            guess = "no prediction (the memory check was off: set zeroshard.memory_budget_gb to run it)"
        raise ZeroshardOutOfMemoryError(
            f"out of memory on rank {rank} in the {where}{step}: {guess}, actual {_actual_peak(device)}."
            f"{_snapshot(device, rank, recording)} The error: {exc}"
        ) from exc
    finally:
        faults.where.phase, faults.where.unit = previous, unit
