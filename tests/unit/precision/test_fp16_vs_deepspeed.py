"""zeroshard's fp16 (dynamic loss scale) steps against DeepSpeed 0.19.8's own, recorded by
tests/fixtures/deepspeed/fp16_steps.py: one rank, ZeRO 2 and 3, model.py's weights and batches,
5 steps (the fixtures' config: scale 2**8, window 2, so the scale doubles after steps 2 and 4).

The one difference is DeepSpeed's order inside step(): it updates the loss scale *before*
unscaling, so on a step that doubles the scale the gradients (made with scale S) are divided by
2S, and clipping compares half the norm with the threshold. zeroshard divides by the S the
backward used. The tests show that this is the whole difference:
- with a window the run never reaches (1000: the scale stays at 2**8) the engines agree;
- zeroshard's run does not depend on when its scale grows (window 2 equals DeepSpeed's window 1000);
- zeroshard with the loss halved on the steps where DeepSpeed's scale grows ends where DeepSpeed does.
Tolerances: stage 2 is bitwise (both engines run torch's AdamW on the same fp32 masters).
Stage 3: rtol 1e-5, atol 1e-9 (the engines' stage-3 arithmetic differs by float32 rounding;
measured max relative difference 2.6e-7 after 5 steps); the losses are bitwise at both stages.
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.unit.checkpoint.deepspeed_fixtures import FIXTURES, fixture_model
from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state

TOLERANCE = {2: {"rtol": 0.0, "atol": 0.0}, 3: {"rtol": 1e-5, "atol": 1e-9}}


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


def assert_state(got: dict, want: dict, stage: int) -> None:
    for key in ("fp32", "exp_avg", "exp_avg_sq"):
        for name, value in want[key].items():
            torch.testing.assert_close(got[key][name], value, **TOLERANCE[stage], msg=f"{key} of {name}")


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_equals_deepspeed_while_the_scale_does_not_grow(stage: int, deepspeed_runs: dict) -> None:
    want = deepspeed_runs[f"s{stage}_window1000"]
    got = zeroshard_run(stage, 1000)
    assert [s["scale_after"] for s in got["steps"]] == [s["scale_after"] for s in want["steps"]] == [256.0] * 5
    assert [s["skipped"] for s in got["steps"]] == [s["skipped"] for s in want["steps"]] == [0] * 5
    assert [s["loss"] for s in got["steps"]] == [s["loss"] for s in want["steps"]]
    torch.testing.assert_close([s["grad_norm"] for s in got["steps"]], [s["grad_norm"] for s in want["steps"]],
                               **TOLERANCE[stage])
    assert_state(got, want, stage)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_unscales_by_the_grown_scale(stage: int, deepspeed_runs: dict) -> None:
    deepspeed_grows = deepspeed_runs[f"s{stage}_window2"]
    grew_at = frozenset(i for i, s in enumerate(deepspeed_grows["steps"]) if s["scale_after"] > s["scale_before"])
    assert grew_at == {2, 4}
    plain = zeroshard_run(stage, 2)
    # zeroshard: the same scale trajectory as DeepSpeed, and a result that does not depend on it.
    assert [s["scale_after"] for s in plain["steps"]] == [s["scale_after"] for s in deepspeed_grows["steps"]]
    assert_state(plain, deepspeed_runs[f"s{stage}_window1000"], stage)
    # DeepSpeed's growth steps use half the gradient (measured: 0.51 apart, the moments after 5 steps).
    assert relative_difference(plain, deepspeed_grows) > 0.1
    # Halving the loss on exactly those steps reproduces DeepSpeed's run.
    halved = zeroshard_run(stage, 2, grew_at)
    assert [s["loss"] for s in halved["steps"]] == [s["loss"] for s in deepspeed_grows["steps"]]
    assert_state(halved, deepspeed_grows, stage)
