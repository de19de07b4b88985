"""Rank-side scenarios for tests/dist/comm/test_fault_injection.py: ranks that fall out of step.

Each task returns what it saw (the error's type and message, how long it took) instead of
raising, and ends by destroying the process group when a collective failed (gloo may hold
half-finished traffic), so the pool starts fresh workers for the next task.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.harness import discard_workers
from tests.dist.scenarios.common import Case, build_engine, case_batches, my_micro_batch
from zeroshard.comm.faults import HangError


def _outcome(error: BaseException | None, started: float) -> dict[str, Any]:
    return {
        "type": type(error).__name__ if error is not None else None,
        "message": str(error) if error is not None else "",
        "diagnosis": getattr(error, "diagnosis", None),  # a HangError's, the same on every rank
        "seconds": time.monotonic() - started,
    }


def rank0_only_no_grad_forward(case: Case, stay_s: float) -> dict[str, Any]:
    """Rank 0 alone runs a no_grad forward at stage 3 (an evaluation on rank 0 only); rank 1
    stays alive, outside any collective, for `stay_s` seconds. Each rank's outcome is returned."""
    engine = build_engine(case)
    tokens, targets = my_micro_batch(case_batches(case)[0], 0, case)
    started = time.monotonic()
    error = None
    if dist.get_rank() == 0:
        try:
            with torch.no_grad():
                engine(tokens, targets)
        except Exception as exc:  # the outcome under test
            error = exc
    else:
        try:
            time.sleep(stay_s)  # the hang watchdog interrupts this rank too
        except HangError as exc:
            error = exc
    outcome = _outcome(error, started)
    # The gathers in flight cannot be cancelled (gloo): fresh workers for the next task.
    discard_workers()
    return outcome


class _InjectedFailure(RuntimeError):
    pass


def rank_falls_behind(case: Case, bad_rank: int, bad_step: int) -> dict[str, Any]:
    """Train `case.steps` steps; on `bad_rank`, the forward of step `bad_step` raises (a
    forward hook), the loop catches it and carries on with the next batch, as a user loop
    that skips a bad batch would. Returns the first error the loop saw, and at which step."""
    engine = build_engine(case)
    raised = {"done": False}

    def fail_once(module, args, output):
        if dist.get_rank() == bad_rank and engine.global_steps == bad_step and not raised["done"]:
            raised["done"] = True
            raise _InjectedFailure("injected")

    engine.module.register_forward_hook(fail_once)
    started = time.monotonic()
    error, loop_step = None, None
    for step, batch in enumerate(case_batches(case)):
        loop_step = step  # reported with the outcome: the batch the loop had reached when it stopped
        tokens, targets = my_micro_batch(batch, 0, case)
        try:
            loss = engine(tokens, targets)
        except _InjectedFailure:
            continue  # the user's loop skips the batch: this rank is now one batch behind
        try:
            engine.backward(loss)
            engine.step()
        except Exception as exc:  # the outcome under test
            error = exc
            break
    outcome = _outcome(error, started)
    outcome["global_steps"] = engine.global_steps
    outcome["loop_step"] = loop_step
    return outcome
