"""The 2-rank DeepSpeed 0.19.8 fixtures resumed by zeroshard on 2 ranks (gloo, CPU) at the stage and
precision that saved them, against DeepSpeed's own uninterrupted run; the universal checkpoint on
2 ranks at stage 3.

Right after the load: bitwise (tolerance 0), masters, moments, counters and loss scale. The
losses DeepSpeed recorded (the first is the loaded weights' own) are numbers from another machine:
within the stated ulps of the run's parameter dtype (tests/unit/checkpoint/fixture_reference.py;
every loss of the fp32 runs, the first of the 16-bit ones, whose later losses move with the
reductions below).
After M more steps, relative to the largest value of each tensor (max |zeroshard - DeepSpeed| / max |DeepSpeed|):
- fp32: measured 2.4e-7 (the two engines sum the ranks' gradients in another order); tested 1e-5.
- bf16: measured 5.5e-3 (the engines reduce 16-bit gradients across ranks differently); tested 2e-2.
- fp16: DeepSpeed unscales by the already-doubled loss scale on a step where the scale grows
  (step 4 here: 512 at the save, window 2), so zeroshard halves the loss on that step to follow
  it (tests/unit/precision/test_fp16_vs_deepspeed.py). Measured 8.4e-4 (DeepSpeed sums the ranks'
  gradients in fp16, zeroshard in fp32; without the halving: 0.71); tested 5e-3.
"""

from __future__ import annotations

import torch

from tests.unit.checkpoint.deepspeed_fixtures import UNIVERSAL, UNIVERSAL_FROM, ckpt, expected, parse_case
from tests.unit.checkpoint.fixture_reference import assert_values_within_ulps
from tests.unit.checkpoint.test_deepspeed_resume import assert_same, engine_for, snapshot, train

TWO_RANK_CASES = ["s0_bf16_w2", "s1_fp32_w2_adam", "s2_bf16_w2", "s2_fp16_w2", "s3_fp32_w2"]
AFTER_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 5e-3}


def relative_difference(got: dict, want: dict) -> float:
    """max |got - want| / max |want| over every parameter's masters and moments."""
    return max(float((got[k][n] - w).abs().max() / w.abs().max())
               for k in ("fp32", "exp_avg", "exp_avg_sq") for n, w in want[k].items())


def resume_on_two_ranks(cases: list[str]) -> dict:
    rank = torch.distributed.get_rank()
    out = {}
    for case in cases:
        stage, precision, world, optimizer = parse_case(case)
        engine = engine_for(stage, precision, world, optimizer)
        want = expected(case)
        _, client_state = engine.load_checkpoint(str(ckpt(case)))
        assert client_state == {"epoch": 7, "note": "from deepspeed"}, f"{case}: client state {client_state}"
        assert_same(snapshot(engine), want["at_save"])
        out[case] = {"scale": engine.loss_scaler.state_dict().get("scale"),
                     "counters": (engine.global_steps, engine.global_samples)}
        halve = frozenset({4}) if precision == "fp16" else frozenset()  # DeepSpeed's scale doubles on step 4
        out[case]["losses"] = train(engine, precision, world, rank, halve)
        out[case]["after_rel"] = relative_difference(snapshot(engine), want["after"])
        out[case]["scale_after"] = engine.loss_scaler.state_dict().get("scale")
    engine = engine_for(3, "bf16", 2)
    engine.load_checkpoint(str(UNIVERSAL))
    assert_same(snapshot(engine), expected(UNIVERSAL_FROM)["at_save"])
    return out


def test_two_rank_deepspeed_checkpoints_resume(dist_pool) -> None:
    results = dist_pool(2).run(resume_on_two_ranks, TWO_RANK_CASES, timeout=300)[0]  # rank 0, as DeepSpeed's
    for case in TWO_RANK_CASES:
        want, got = expected(case), results[case]
        precision = parse_case(case)[1]
        assert got["counters"] == (want["at_save"]["global_steps"], want["at_save"]["global_samples"]), case
        assert_values_within_ulps(got["losses"][:1], want["losses_after"][:1], precision)  # the loaded weights'
        if AFTER_RTOL[precision] is not None:
            assert got["after_rel"] <= AFTER_RTOL[precision], (case, got["after_rel"])
        if precision == "fp32":
            assert_values_within_ulps(got["losses"], want["losses_after"], precision)
    assert results["s2_fp16_w2"]["scale"] == expected("s2_fp16_w2")["at_save"]["loss_scale"]
    assert results["s2_fp16_w2"]["scale_after"] == expected("s2_fp16_w2")["after"]["loss_scale"] == 1024.0
