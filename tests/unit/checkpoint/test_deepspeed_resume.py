"""A run DeepSpeed 0.19.8 trained K steps and saved, resumed by zeroshard for M steps, ends where
DeepSpeed's own uninterrupted run ended after K+M steps (one process; the 2-rank fixtures are
resumed in tests/dist/checkpoint/test_deepspeed_resume.py).

Right after the load: bitwise (the load only moves elements). After M more steps, two checks:
bitwise against the same M steps computed here by plain torch from DeepSpeed's recorded state
(both on this machine), and within the stated ulps of DeepSpeed's recorded numbers (another
machine's kernels and threads round differently; the table and the measurements are in
tests/unit/checkpoint/fixture_reference.py).
"""

from __future__ import annotations

import pytest
import torch

import zeroshard
from tests.unit.checkpoint.deepspeed_fixtures import (
    DTYPES,
    UNIVERSAL,
    UNIVERSAL_FROM,
    ckpt,
    expected,
    fixture_model,
    parse_case,
)
from tests.unit.checkpoint.fixture_reference import (
    assert_bitwise,
    assert_values_within_ulps,
    assert_within_ulps,
    from_recorded,
)
from tests.unit.checkpoint.fixture_reference import train as torch_train
from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state


def engine_for(stage: int, precision: str, world: int, optimizer: str = "AdamW", extra: dict | None = None):
    M = fixture_model()
    net = M.make_model()
    config = M.ds_config(stage, precision, world, optimizer)
    config.update(extra or {})
    engine, *_ = zeroshard.initialize(model=net, model_parameters=net.parameters(), config=config)
    return engine


def snapshot(engine) -> dict:
    out: dict = {"fp32": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        out["fp32"][name] = safe_get_full_fp32_param(p).float()
        for key in ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).float()
    return out




def assert_same(got: dict, want: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    for kind in ("fp32", "exp_avg", "exp_avg_sq"):
        for name, value in want[kind].items():
            torch.testing.assert_close(got[kind][name], value, rtol=rtol, atol=atol, msg=f"{kind} of {name}")


def train(engine, precision: str, world: int, rank: int = 0,
          halve_loss_at: frozenset[int] = frozenset()) -> list[float]:
    """M_STEPS steps; the loss is halved on the steps in `halve_loss_at` (how zeroshard reproduces
    DeepSpeed's fp16 step on which the loss scale grows, tests/unit/precision/test_fp16_vs_deepspeed.py)."""
    M = fixture_model()
    losses = []
    for step in range(M.K_STEPS, M.K_STEPS + M.M_STEPS):
        x, y = M.batch(step, rank, world, DTYPES[precision])
        loss = engine(x, y)
        engine.backward(loss * 0.5 if step in halve_loss_at else loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize("case", ["s0_fp32_w1", "s1_bf16_w1", "s2_fp32_w1", "s3_bf16_w1"])
def test_deepspeed_checkpoint_resumes_exactly(case: str) -> None:
    stage, precision, world, optimizer = parse_case(case)
    engine = engine_for(stage, precision, world, optimizer)
    want = expected(case)
    path, client_state = engine.load_checkpoint(str(ckpt(case)))
    assert path == str(ckpt(case) / "global_step3")
    assert client_state == {"epoch": 7, "note": "from deepspeed"}
    assert engine.global_steps == want["at_save"]["global_steps"]
    assert engine.global_samples == want["at_save"]["global_samples"]
    assert engine.lr_scheduler.state_dict() == want["at_save"]["lr_scheduler"]
    assert_same(snapshot(engine), want["at_save"])
    losses, got = train(engine, precision, world), snapshot(engine)
    M = fixture_model()
    reference = torch_train(from_recorded(want["at_save"]), precision, range(M.K_STEPS, M.K_STEPS + M.M_STEPS))
    assert losses == [s["loss"] for s in reference.steps]
    assert_bitwise(got, reference.state())
    assert_values_within_ulps(losses, want["losses_after"], precision)
    assert_within_ulps(got, want["after"], precision)
    assert engine.global_steps == want["after"]["global_steps"]


@pytest.mark.parametrize(("case", "stage"), [("s3_fp32_w2", 1), ("s1_fp32_w2_adam", 3)])
def test_deepspeed_checkpoint_loads_at_another_world_size_and_stage(case: str, stage: int) -> None:
    """A 2-rank checkpoint on 1 rank at another stage: bitwise DeepSpeed's state right after the load."""
    _, precision, _, optimizer = parse_case(case)
    engine = engine_for(stage, precision, 1, optimizer)
    engine.load_checkpoint(str(ckpt(case)))
    assert_same(snapshot(engine), expected(case)["at_save"])


@pytest.mark.parametrize("stage", [0, 3])
def test_universal_checkpoint_loads_at_any_stage(stage: int) -> None:
    """ds_to_universal's output of a 2-rank ZeRO-2 bf16 run, on 1 rank at stages 0 and 3; the save
    directory has only DeepSpeed's `latest_universal`, which load_checkpoint reads."""
    engine = engine_for(stage, "bf16", 1)
    path, client_state = engine.load_checkpoint(str(UNIVERSAL))
    assert path == str(UNIVERSAL / "global_step3")
    assert client_state == {"epoch": 7, "note": "from deepspeed"}
    assert_same(snapshot(engine), expected(UNIVERSAL_FROM)["at_save"])
