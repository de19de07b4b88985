"""Rank-side scenarios for tests/dist/grads/test_backward_styles.py: one step function per style.

Each style drives one optimizer step up to, not including, the boundary `engine.step()`
(which `common.train` calls after reading the gradients), and returns this rank's losses.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any

import torch

from tests.dist.reference import mean_cross_entropy
from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    detached,
    engine_loop_step,
    my_micro_batch,
    train,
)


def plain_backward_step(engine, case: Case, batch) -> list[float]:
    """`loss.backward()` instead of `engine.backward(loss)`."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        loss.backward()
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def nonscalar_backward_step(engine, case: Case, batch) -> list[float]:
    """`logits.backward(dloss/dlogits)`: a non-scalar backward from the model's output."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        logits = engine(tokens)
        leaf = logits.detach().requires_grad_()
        loss = mean_cross_entropy(leaf, targets)
        (grad_logits,) = torch.autograd.grad(loss, leaf)
        logits.backward(grad_logits)
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def module_loss_step(engine, case: Case, batch) -> list[float]:
    """The loss is built from `engine.module(...)` outputs, not from `engine(...)`."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = mean_cross_entropy(engine.module(tokens), targets)
        engine.backward(loss)
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def boundary_flag_step(engine, case: Case, batch) -> list[float]:
    """k backward calls and one step: `set_gradient_accumulation_boundary(False)` before
    all but the last backward, True before the last."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        engine.set_gradient_accumulation_boundary(j == case.ga - 1)
        loss = engine(tokens, targets)
        engine.backward(loss)
        losses.append(detached(loss))
    return losses


def no_sync_step(engine, case: Case, batch) -> list[float]:
    """The DeepSpeed loop with every micro-step but the last inside `engine.no_sync()`."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        quiet = engine.no_sync() if j < case.ga - 1 else contextlib.nullcontext()
        with quiet:
            loss = engine(tokens, targets)
            engine.backward(loss)
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def two_backward_step(engine, case: Case, batch) -> list[float]:
    """gradient_accumulation_steps = 1 and two backward calls before the step: the update
    uses the sum of both gradients (docs/design.md section 4). The batch has two micro-batches."""
    assert case.ga == 1
    losses = []
    for j in range(2):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        engine.backward(loss)
        losses.append(detached(loss))
    return losses


STYLES = {
    "engine": engine_loop_step,
    "plain": plain_backward_step,
    "nonscalar": nonscalar_backward_step,
    "module_loss": module_loss_step,
    "ckpt_reentrant": engine_loop_step,
    "ckpt_nonreentrant": engine_loop_step,
    "tiled_loss": engine_loop_step,
    "boundary_flag": boundary_flag_step,
    "no_sync": no_sync_step,
    "two_backward": two_backward_step,
}
# Styles that are a model option rather than a different loop.
STYLE_MODEL_KWARGS: dict[str, dict[str, Any]] = {
    "ckpt_reentrant": {"checkpointing": "reentrant"},
    "ckpt_nonreentrant": {"checkpointing": "non_reentrant"},
    "tiled_loss": {"tiled_loss_chunks": 3},
}
# Backward calls per micro-step slot of the global batch (two_backward reads 2 micro-batches).
STYLE_BACKWARD_CALLS = {"two_backward": 2}


def style_case(case: Case) -> Case:
    """`case` with its style's model options filled in."""
    return replace(case, model_kwargs={**case.model_kwargs, **STYLE_MODEL_KWARGS.get(case.style, {})})


def run_style_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Train every case with its style; one result per case (see `common.train`)."""
    results = []
    for case in cases:
        case = style_case(case)
        batches = case_batches(case, STYLE_BACKWARD_CALLS.get(case.style, 1))
        engine = build_engine(case)
        results.append(train(engine, case, STYLES[case.style], batches))
    return results
