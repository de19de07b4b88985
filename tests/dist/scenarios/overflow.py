"""Rank-side scenarios for tests/dist/step/test_overflow_clipping.py."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    engine_loop_step,
    full_masters,
    full_optimizer_state,
)

# What the optimizer state of AdamW holds (torch's names), all compared after a skipped step.
ADAMW_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
# The parameter whose gradient gets an inf on the bad rank.
POISONED_PARAM = "blocks.0.fc.weight"


def _poison(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad.view(-1)[0] = float("inf")
    return grad


class _ListHandler(logging.Handler):
    def __init__(self, into: list[tuple[str, str]]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append((record.levelname, record.getMessage()))


@contextlib.contextmanager
def captured_log() -> Iterator[list[tuple[str, str]]]:
    """The "zeroshard" logger's messages, (level name, text), while the block runs."""
    said: list[tuple[str, str]] = []
    logger = logging.getLogger("zeroshard")
    handler, previous = _ListHandler(said), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def overflow_run(cases: list[Case], bad_steps: tuple[int, ...], bad_rank: int) -> list[dict[str, Any]]:
    """Train each case; on `bad_rank` only, at the (0-based) steps in `bad_steps`, one element
    of POISONED_PARAM's gradient becomes inf (a tensor hook, before accumulation).

    Returns per case, per step: the loss scale after the step, skipped_steps, global_steps,
    the full masters and the full AdamW state after the step, what the "zeroshard" logger
    said during the step; and the initial masters.
    """
    results = []
    for case in cases:
        engine = build_engine(case)
        param = dict(engine.module.named_parameters())[POISONED_PARAM]
        out: dict[str, Any] = {
            "initial_master": full_masters(engine),
            "scale_after": [],
            "skipped": [],
            "global_steps": [],
            "master": [],
            "state": [],
            "grad_norms": [],
            "losses": [],
            "log": [],
        }
        for index, batch in enumerate(case_batches(case)):
            handle = param.register_hook(_poison) if index in bad_steps and dist.get_rank() == bad_rank else None
            out["losses"].append(engine_loop_step(engine, case, batch))
            with captured_log() as said:
                engine.step()
            out["log"].append(said)
            if handle is not None:
                handle.remove()
            out["scale_after"].append(engine.loss_scale)
            out["skipped"].append(engine.skipped_steps)
            out["global_steps"].append(engine.global_steps)
            out["grad_norms"].append(engine.get_global_grad_norm())
            out["master"].append(full_masters(engine))
            out["state"].append({key: full_optimizer_state(engine, key) for key in ADAMW_STATE_KEYS})
        results.append(out)
    return results
