"""zeroshard's fp16 (dynamic loss scale) steps against DeepSpeed 0.19.8's own, recorded by
tests/fixtures/deepspeed/fp16_steps.py: one rank, ZeRO 2 and 3, model.py's weights and batches,
5 steps (the fixtures' config: scale 2**8, window 2, so the scale doubles after steps 2 and 4).

The one difference is DeepSpeed's order inside step(): it updates the loss scale *before*
unscaling, so on a step that doubles the scale the gradients (made with scale S) are divided by
2S, and clipping compares half the norm with the threshold. zeroshard divides by the S the
backward used. The tests show that this is the whole difference:
- with a window the run never reaches (1000: the scale stays at 2**8) the engines agree;
- zeroshard's run does not depend on when its scale grows (window 2 gives the same bits as a
  constant scale);
- zeroshard with the loss halved on the steps where DeepSpeed's scale grows ends where DeepSpeed does.

Tolerances: every zeroshard run is bitwise the same five steps computed here by plain torch
(losses, grad norms, masters, moments); DeepSpeed's recorded numbers are compared within the
stated fp16 ulps (masters and moments 1, losses and grad norms 1/16; the table and what was
measured: tests/unit/checkpoint/fixture_reference.py).
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.unit.checkpoint.deepspeed_fixtures import FIXTURES, fixture_model
from tests.unit.checkpoint.fixture_reference import (
    assert_bitwise,
    assert_values_within_ulps,
    assert_within_ulps,
    from_scratch,
)
from tests.unit.checkpoint.fixture_reference import train as torch_train
from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state


@pytest.fixture(scope="module")
def deepspeed_runs() -> dict:
    return torch.load(FIXTURES / "fp16_steps.pt", weights_only=True)


def zeroshard_run(stage: int, window: int, halve_loss_at: frozenset[int] = frozenset()) -> dict:
    M = fixture_model()
    net = M.make_model()
    config = M.ds_config(stage, "fp16", 1)
    config["fp16"]["loss_scale_window"] = window
    engine, *_ = zeroshard.initialize(model=net, model_parameters=net.parameters(), config=config)
    steps = []
    for step in range(5):
        x, y = M.batch(step, 0, 1, torch.float16)
        before = engine.loss_scaler.scale
        loss = engine(x, y)
        engine.backward(loss * 0.5 if step in halve_loss_at else loss)
        engine.step()
        steps.append({"loss": float(loss.detach()), "scale_before": before, "scale_after": engine.loss_scaler.scale,
                      "skipped": engine.skipped_steps, "grad_norm": float(engine.get_global_grad_norm())})
    named = list(engine.module.named_parameters())
    out = {"steps": steps, "fp32": {n: safe_get_full_fp32_param(p).float() for n, p in named}}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: safe_get_full_optimizer_state(p, key).float() for n, p in named}
    return out


def relative_difference(got: dict, want: dict) -> float:
    """max |got - want| / max |want| per tensor, over masters and moments."""
    return max(float((got[k][n] - w).abs().max() / w.abs().max())
               for k in ("fp32", "exp_avg", "exp_avg_sq") for n, w in want[k].items())


def reference(run: dict, halve_loss_at: frozenset[int] = frozenset()) -> dict:
    """The five steps by plain torch, with the loss scale each of `run`'s steps used (a power of
    two: the same bits with any, kept to compute what the engine computed)."""
    scales = [s["scale_before"] for s in run["steps"]]
    return torch_train(from_scratch("fp16"), "fp16", range(5), halve_loss_at, scale_for=lambda step: scales[step])


def assert_is_reference(got: dict, want) -> None:
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in want.steps]
    assert [s["grad_norm"] for s in got["steps"]] == [s["grad_norm"] for s in want.steps]
    assert_bitwise(got, want.state())


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_equals_deepspeed_while_the_scale_does_not_grow(stage: int, deepspeed_runs: dict) -> None:
    want = deepspeed_runs[f"s{stage}_window1000"]
    got = zeroshard_run(stage, 1000)
    assert [s["scale_after"] for s in got["steps"]] == [s["scale_after"] for s in want["steps"]] == [256.0] * 5
    assert [s["skipped"] for s in got["steps"]] == [s["skipped"] for s in want["steps"]] == [0] * 5
    assert_is_reference(got, reference(got))
    assert_values_within_ulps([s["loss"] for s in got["steps"]], [s["loss"] for s in want["steps"]], "fp16")
    assert_values_within_ulps([s["grad_norm"] for s in got["steps"]], [s["grad_norm"] for s in want["steps"]], "fp16")
    assert_within_ulps(got, want, "fp16")


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_unscales_by_the_grown_scale(stage: int, deepspeed_runs: dict) -> None:
    deepspeed_grows = deepspeed_runs[f"s{stage}_window2"]
    grew_at = frozenset(i for i, s in enumerate(deepspeed_grows["steps"]) if s["scale_after"] > s["scale_before"])
    assert grew_at == {2, 4}
    plain = zeroshard_run(stage, 2)
    # zeroshard: the same scale trajectory as DeepSpeed, and a result that does not depend on it
    # (the constant-scale reference's bits).
    assert [s["scale_after"] for s in plain["steps"]] == [s["scale_after"] for s in deepspeed_grows["steps"]]
    constant = torch_train(from_scratch("fp16"), "fp16", range(5), scale_for=lambda step: 256.0)
    assert_is_reference(plain, constant)
    # DeepSpeed's growth steps use half the gradient (measured: 0.51 apart, the moments after 5 steps).
    assert relative_difference(plain, deepspeed_grows) > 0.1
    # Halving the loss on exactly those steps reproduces DeepSpeed's run.
    halved = zeroshard_run(stage, 2, grew_at)
    assert_is_reference(halved, reference(halved, grew_at))
    assert_values_within_ulps([s["loss"] for s in halved["steps"]], [s["loss"] for s in deepspeed_grows["steps"]],
                              "fp16")
    assert_within_ulps(halved, deepspeed_grows, "fp16")
