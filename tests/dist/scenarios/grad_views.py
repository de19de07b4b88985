"""Rank-side scenario for tests/dist/grads/test_grad_views.py: `param.grad` after the boundary
backward, read the way DeepSpeed users read it."""

from __future__ import annotations

from typing import Any

import torch

import zeroshard
from tests.dist.reference import TrainSettings
from tests.dist.scenarios.common import Case, build_engine, case_batches, my_micro_batch

GRAD_VIEW_SETTINGS = TrainSettings(optimizer="SGD", weight_decay=0.0, momentum=0.0)


def grad_views(stage: int, mode: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    # SGD without weight decay: a zero gradient leaves the weights exactly as they were.
    case = Case(stage=stage, mode=mode, ga=2, steps=1, settings=GRAD_VIEW_SETTINGS, extra=extra or {})
    engine = build_engine(case)
    batch = case_batches(case)[0]
    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    out: dict[str, Any] = {}
    tokens, targets = my_micro_batch(batch, 0, case)
    engine.backward(engine(tokens, targets))
    out["after_first"] = [p.grad is None for p in engine.module.parameters()]
    engine.step()
    tokens, targets = my_micro_batch(batch, 1, case)
    engine.backward(engine(tokens, targets))  # the boundary backward
    params = dict(engine.module.named_parameters())
    out["grad"] = {n: None if params[n].grad is None else params[n].grad.detach().clone() for n in names}
    out["full"] = {n: zeroshard.safe_get_full_grad(params[n]) for n in names}
    shares = []
    for flat in engine.flats:
        for p in flat.params:
            if p.grad is not None:
                # One buffer: the views, the optimizer's part and the local gradient it was.
                base = flat.grads.reduced_full.untyped_storage().data_ptr()
                shares.append(p.grad.untyped_storage().data_ptr() == base
                              and flat.grads.reduced.untyped_storage().data_ptr() == base)
    out["shares_buffer"] = shares
    before = {n: zeroshard.safe_get_full_fp32_param(params[n]) for n in names}
    with torch.no_grad():
        for n in names:  # what a user may do: change the gradient in place; the step applies it
            if params[n].grad is not None:
                params[n].grad.zero_()
    engine.step()
    out["unchanged_by_zeroed_step"] = all(
        torch.equal(before[n], zeroshard.safe_get_full_fp32_param(params[n])) for n in names
    ) if all(g is not None for g in out["grad"].values()) else None
    out["after_step"] = [p.grad is None for p in engine.module.parameters()]
    # The same batch again (the zeroed step left the weights as they were): no view during
    # the micro-steps; the step's norm is the whole gradient's, each element counted once.
    for j in range(2):
        tokens, targets = my_micro_batch(batch, j, case)
        engine.backward(engine(tokens, targets))
        if j == 0:
            out["during_next"] = [p.grad is None for p in engine.module.parameters()]
            engine.step()
    engine.step()
    out["norm"] = engine.get_global_grad_norm()
    # zero_grad after a boundary backward drops the views with the gradients.
    for j in range(2):
        tokens, targets = my_micro_batch(batch, j, case)
        engine.backward(engine(tokens, targets))
        if j == 0:
            engine.step()
    out["exposed_again"] = any(p.grad is not None for p in engine.module.parameters())
    engine.zero_grad()
    out["after_zero_grad"] = [p.grad is None for p in engine.module.parameters()]
    return out
