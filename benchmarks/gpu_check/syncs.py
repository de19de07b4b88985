"""Check b: host synchronisations in steady-state steps, under `torch.cuda.set_sync_debug_mode`.

A step may wait for the device only where `ALLOWED` says, at most as often as it says, and for
the reason it gives; the row prints the list, so a reader sees what was let through and why.
Every other sync fails the row. A sync with no zeroshard frame on its Python stack (torch code
called from elsewhere, or C++ work in an autograd thread) is reported with its whole stack and
its thread, so the next run says where it is.
"""

from __future__ import annotations

import gc
import os
import threading
import traceback
import warnings
from dataclasses import dataclass
from typing import Any

import torch

import zeroshard
from benchmarks.gpu_check.report import Skip
from tests.dist.scenarios.common import Case, build_engine, case_batches


@dataclass(frozen=True)
class AllowedSync:
    """A sync the design keeps: the innermost zeroshard frame is `function` in `path` (relative to
    the package), at most `per_step` times per optimizer step."""

    path: str
    function: str
    per_step: int
    reason: str

    def describe(self) -> str:
        return f"{self.function} ({self.path}, <= {self.per_step}/step): {self.reason}"


ALLOWED = (
    AllowedSync(
        "step/optimizer_step.py", "global_norm", 1,
        "the step's one host read, of the packed norm all-reduce: whether the norm is finite "
        "(skip the step, update the loss scale), which ranks had a non-finite gradient, and whether "
        "every rank is at the same step (RankDesyncError) are host decisions; see docs/gpu-streams.md",
    ),
)


# The package's own directory: a checkout whose path contains "zeroshard/" must not make its
# tests or benchmarks count as package frames.
PACKAGE = os.path.dirname(os.path.abspath(zeroshard.__file__)) + os.sep


def _relative(frame: traceback.FrameSummary) -> str | None:
    """`frame`'s file relative to the package ("step/optimizer_step.py"), None outside it."""
    path = os.path.abspath(frame.filename)
    return path[len(PACKAGE):].replace(os.sep, "/") if path.startswith(PACKAGE) else None


def _zeroshard_frames(stack: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    return [f for f in stack if _relative(f) is not None]


def _where(frame: traceback.FrameSummary) -> str:
    return f"{_relative(frame)}:{frame.lineno} {frame.name}"


def _allowed(frames: list[traceback.FrameSummary]) -> AllowedSync | None:
    """The allow-list entry of a sync whose innermost zeroshard frame it names, if any."""
    if not frames:
        return None
    inner = frames[-1]
    for entry in ALLOWED:
        if _relative(inner) == entry.path and inner.name == entry.function:
            return entry
    return None


def _record(stack: list[traceback.FrameSummary], message: str) -> dict[str, Any]:
    frames = _zeroshard_frames(stack)
    entry = _allowed(frames)
    seen: dict[str, Any] = {
        "message": message.splitlines()[0][:200],
        "place": " <- ".join(_where(f) for f in reversed(frames[-3:])) or "(no zeroshard frame)",
        "allowed": entry.function if entry else None,
    }
    if not frames:  # say where it is next time: the whole stack, and whose thread
        seen["thread"] = threading.current_thread().name
        seen["stack"] = [f"{f.filename}:{f.lineno} {f.name}" for f in stack[-25:]]
    return seen


def classify(seen: list[dict[str, Any]], steps: int) -> tuple[list[str], list[str]]:
    """(what is wrong, the places of the allowed syncs): a sync not on the allow-list, or an
    entry used more often than `per_step` times `steps`."""
    problems = []
    for s in seen:
        if s["allowed"] is None:
            where = s["place"]
            if "stack" in s:
                during = ", during a garbage collection" if s.get("during_gc") else ""
                where += f" [thread {s['thread']}{during}; stack: " + " <- ".join(reversed(s["stack"])) + "]"
            problems.append(where)
    for entry in ALLOWED:
        used = sum(s["allowed"] == entry.function for s in seen)
        if used > entry.per_step * steps:
            problems.append(f"{entry.function}: {used} syncs in {steps} steps (allowed {entry.per_step} per step)")
    allowed_places = sorted({s["place"] for s in seen if s["allowed"] is not None})
    return problems, allowed_places


def steady_state_syncs(stage: int, mode: str = "bf16", warmup: int = 2, steps: int = 2) -> tuple:
    """After `warmup` steps, `steps` more under the sync debug mode, on fresh engines, twice.

    "warn": every synchronising call becomes a Python warning, raised at the torch call in the
    thread that made it (autograd hooks included), so its stack names the zeroshard frame; all
    are recorded and classified against `ALLOWED`. "error": the first one raises; it must be an
    allowed one (nothing before the step's one read waits for the device); the pass then ends
    (the engine is half-way through a step). Nothing reads the loss or the norm in these steps.
    """
    if not torch.cuda.is_available():
        raise Skip("needs CUDA")
    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=warmup + steps, keep=())
    batches = [(t.to("cuda"), y.to("cuda")) for t, y in case_batches(case)]
    torch.cuda.synchronize()

    def run_steps(engine, which):
        for tokens, targets in which:
            for j in range(case.ga):
                rows = slice(j * case.micro, (j + 1) * case.micro)
                engine.backward(engine(tokens[rows], targets[rows]))
                engine.step()

    seen: list[dict[str, Any]] = []
    engine = build_engine(case)
    try:
        run_steps(engine, batches[:warmup])
        torch.cuda.synchronize()
        shown = warnings.showwarning
        # Whether the garbage collector is running when a sync is seen: a finalizer runs on
        # whatever stack the collection interrupted, which then names the wrong code.
        collecting = [False]

        def on_gc(phase, info):
            collecting[0] = phase == "start"

        def record(message, category, filename, lineno, file=None, line=None):
            # torch warns once per process, on the first set_sync_debug_mode, that the mode is
            # a prototype: that warning names no synchronisation (run 2 counted it as one).
            if "synchroniz" in str(message) and "prototype feature" not in str(message):
                seen.append({**_record(traceback.extract_stack()[:-1], str(message)), "during_gc": collecting[0]})
            else:
                shown(message, category, filename, lineno, file, line)

        gc.callbacks.append(on_gc)
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run_steps(engine, batches[warmup:])
            finally:
                torch.cuda.set_sync_debug_mode("default")
                gc.callbacks.remove(on_gc)
            torch.cuda.synchronize()
    finally:
        engine.destroy()

    first_error: dict[str, Any] | None = None
    engine = build_engine(case)
    try:
        run_steps(engine, batches[:warmup])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run_steps(engine, batches[warmup:])
        except RuntimeError as error:
            first_error = _record(traceback.extract_tb(error.__traceback__), str(error))
        finally:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        engine.destroy()

    problems, allowed_places = classify(seen, steps)
    if first_error is not None and first_error["allowed"] is None:
        problems.append("error mode, first: " + classify([first_error], steps)[0][0])
    numbers = {
        "syncs": len(seen),
        "allowed": sum(s["allowed"] is not None for s in seen),
        "not_allowed": sum(s["allowed"] is None for s in seen),
        "allowed_places": allowed_places,
        "error_mode_first": first_error,
        "allow_list": [entry.describe() for entry in ALLOWED],
        "unattributed": [s for s in seen if "stack" in s],
    }
    if problems:
        return "FAIL", numbers, f"{len(problems)} sync problem(s) in {steps} steady-state steps: " + "; ".join(problems)
    return "ok", numbers, ""


def print_allow_list() -> None:
    """The syncs a step may make, and why (printed once before the rows)."""
    print("[gpu_check] host syncs allowed in a steady-state step:", flush=True)
    for entry in ALLOWED:
        print("    " + entry.describe(), flush=True)
