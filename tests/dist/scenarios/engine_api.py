"""Rank-side scenarios for tests/dist/engine/test_engine_api.py: DeepSpeed's engine methods in the
loops DeepSpeed users write (engine.scale, scale_wrt_gas, unmanaged accumulation, counters)."""

from __future__ import annotations

from typing import Any

import torch

from tests.dist.scenarios.common import (
    Case,
    build_engine,
    case_batches,
    detached,
    engine_loop_step,
    my_micro_batch,
    train,
)
from zeroshard.comm import collectives as comm


def scaled_step(engine, case: Case, batch) -> list[float]:
    """`engine.scale(loss).backward()` for every micro-step (DeepSpeed's manual backward)."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        scaled = engine.scale(loss)
        torch.testing.assert_close(scaled.detach(), loss.detach() * engine.loss_scale, rtol=0, atol=0)
        scaled.backward()
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def scaled_then_plain_step(engine, case: Case, batch) -> list[float]:
    """`engine.scale(loss).backward()` and plain `loss.backward()` in turn: a scaled backward
    must not leave the engine believing the next one is scaled too."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        (engine.scale(loss) if j % 2 == 0 else loss).backward()
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def no_gas_scaling_step(engine, case: Case, batch) -> list[float]:
    """`engine.backward(loss / k, scale_wrt_gas=False)`: the script divides by the accumulation
    steps itself, so the update equals the default loop's."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        mine = loss / case.ga
        returned = engine.backward(mine, scale_wrt_gas=False)
        assert returned is mine, "backward(scale_wrt_gas=False) returns the loss it was given"
        losses.append(detached(loss))
        if j < case.ga - 1:
            engine.step()
    return losses


def unmanaged_step(engine, case: Case, batch) -> list[float]:
    """managed_gradient_accumulation false: k backward calls, no step between them; the
    caller's engine.step() is the boundary."""
    losses = []
    for j in range(case.ga):
        tokens, targets = my_micro_batch(batch, j, case)
        loss = engine(tokens, targets)
        assert not engine.is_gradient_accumulation_boundary(), "unmanaged: only step() is the boundary"
        engine.backward(loss)
        losses.append(detached(loss))
    try:
        engine.set_gradient_accumulation_boundary(True)
    except RuntimeError as exc:
        assert "managed_gradient_accumulation" in str(exc), str(exc)
    else:
        raise AssertionError("set_gradient_accumulation_boundary must be refused in unmanaged mode")
    return losses


def coalesce_step(engine, case: Case, batch) -> list[float]:
    """Two backward calls inside `engine.coalesce_grad_reduction()` (accumulation 1): no
    gradient collective inside the block, one reduction on exit; step() inside is refused."""
    losses = []
    with engine.coalesce_grad_reduction():
        with comm.recording() as inside:
            for j in range(2):
                tokens, targets = my_micro_batch(batch, j, case)
                loss = engine(tokens, targets)
                engine.backward(loss)
                losses.append(detached(loss))
        try:
            engine.step()
        except RuntimeError as exc:
            assert "coalesce_grad_reduction" in str(exc), str(exc)
        else:
            raise AssertionError("step() inside coalesce_grad_reduction must be refused")
        with comm.recording() as exit_log:
            pass
    grads_inside = [r for r in inside.records if r.tag == "grad"]
    assert not grads_inside, f"gradient collectives inside the block: {grads_inside}"
    assert not exit_log.records
    assert engine.is_gradient_accumulation_boundary(), "the step after the block is the boundary"
    return losses


STYLES = {
    "engine": engine_loop_step,
    "scaled": scaled_step,
    "scaled_then_plain": scaled_then_plain_step,
    "no_gas_scaling": no_gas_scaling_step,
    "unmanaged": unmanaged_step,
    "coalesce": coalesce_step,
}
BACKWARD_CALLS = {"coalesce": 2}


def run_api_cases(cases: list[Case]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        engine = build_engine(case)
        batches = case_batches(case, BACKWARD_CALLS.get(case.style, 1))
        results.append(train(engine, case, STYLES[case.style], batches))
    return results


def counters(stage: int) -> dict[str, Any]:
    """was_step_applied, global_samples, micro_steps through a DeepSpeed loop with
    accumulation 2, an fp16 overflow, and the unmanaged mode's sample count."""
    out: dict[str, Any] = {"applied": [], "samples": []}
    case = Case(stage=stage, mode="fp16", ga=2, steps=3)
    engine = build_engine(case)
    batches = case_batches(case)
    for index, batch in enumerate(batches):
        for j in range(case.ga):
            tokens, targets = my_micro_batch(batch, j, case)
            loss = engine(tokens, targets)
            if index == 1 and j == 1:
                loss = loss * float("inf")  # an overflow in the boundary micro-step
            engine.backward(loss)
            engine.step()
            out["applied"].append(engine.was_step_applied())
            out["samples"].append(engine.global_samples)
    out["skipped"] = engine.skipped_steps
    out["queries"] = (engine.fp16_enabled(), engine.bfloat16_enabled(), engine.zero_optimization_stage(),
                      engine.gradient_clipping(), engine.managed_gradient_accumulation())

    unmanaged = build_engine(Case(stage=stage, mode="fp32", ga=2, steps=1,
                                  extra={"managed_gradient_accumulation": False}))
    tokens, targets = my_micro_batch(batches[0], 0, case)
    for _ in range(3):
        unmanaged.backward(unmanaged(tokens, targets))
    unmanaged.step()
    out["unmanaged"] = (unmanaged.global_samples, unmanaged.global_steps, unmanaged.was_step_applied(),
                        unmanaged.micro_steps)
    return out


def partition_cache_and_destroy(stage: int) -> dict[str, Any]:
    """empty_partition_cache between steps changes nothing; after destroy the module is a
    plain module again (its parameters keep their .grad)."""
    case = Case(stage=stage, mode="fp32", ga=1, steps=2, keep=("master",))
    batches = case_batches(case)
    plain = train(build_engine(case), case, engine_loop_step, batches)

    def emptying_step(engine, case, batch):
        engine.empty_partition_cache()
        states = {f.state.value for f in engine.flats}
        losses = engine_loop_step(engine, case, batch)
        engine.empty_partition_cache()
        return losses + [float(len(states))]

    engine = build_engine(case)
    emptied = train(engine, case, emptying_step, batches)
    states_after = sorted({f.state.value for f in engine.flats})
    engine.destroy()
    grads = None
    if stage < 3:  # whole parameters: usable as a plain module
        tokens, targets = my_micro_batch(batches[0], 0, case)
        engine.module.zero_grad(set_to_none=True)
        engine.module(tokens, targets).backward()
        grads = [p.grad is not None for p in engine.module.parameters() if p.requires_grad and p.grad is not None]
    return {"plain": plain["master"], "emptied": emptied["master"], "states_after": states_after, "grads": grads}


def zero_init(stage: int) -> dict[str, Any]:
    """A model built under `zeroshard.zero.Init` trains exactly as one built without it."""
    import zeroshard
    from tests.dist.reference import build_model
    from tests.dist.scenarios.common import engine_config

    case = Case(stage=stage, mode="fp32", ga=1, steps=2, keep=("master",))
    config = engine_config(case)
    with zeroshard.zero.Init(config_dict_or_path=config) as ctx:
        model = build_model(case.seed)
    engine, *_ = zeroshard.initialize(model=model, config=config)
    inside = train(engine, case, engine_loop_step, case_batches(case))
    plain = train(build_engine(case), case, engine_loop_step, case_batches(case))
    storage = sorted({p.untyped_storage().nbytes() == 0 for p in engine.module.parameters() if p.requires_grad})
    return {"stage": ctx.stage, "inside": inside["master"], "plain": plain["master"], "empty_storage": storage}
