"""Reading DeepSpeed 0.19.8's checkpoints, checked against what DeepSpeed itself read from them.

Every number comes from tests/fixtures/deepspeed/ (written by the real DeepSpeed, see
regenerate.py): `safe_get_full_fp32_param` / `safe_get_full_optimizer_state` at the save, and
`zero_to_fp32`. Reading only moves elements, so the comparisons are exact (tolerance 0).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.checkpoint.deepspeed_fixtures import (
    CASES,
    UNIVERSAL,
    UNIVERSAL_FROM,
    ckpt,
    expected,
    parse_case,
    zero_to_fp32,
)
from zeroshard.checkpoint import consolidate_fp32
from zeroshard.checkpoint.deepspeed.convert import from_deepspeed, read_any_deepspeed
from zeroshard.checkpoint.deepspeed.zs_format import read_zeroshard


def _assert_state_equals_deepspeed(state, want: dict) -> None:
    assert sorted(state.names) == sorted(want["fp32"])
    for name in state.names:
        torch.testing.assert_close(state.masters[name], want["fp32"][name], rtol=0, atol=0, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state.optimizer_state[name][key].float(), want[key][name], rtol=0, atol=0,
                                       msg=f"{key} of {name}")
    assert state.steps == [want["step"]] * len(state.groups)
    assert state.global_steps == want["global_steps"]
    assert state.global_samples == want["global_samples"]
    assert state.lr_scheduler == want["lr_scheduler"]
    assert [h["lr"] for h in state.hyper] == want["lr"]


@pytest.mark.parametrize("case", CASES)
def test_reads_what_deepspeed_reads(case: str) -> None:
    stage, precision, world, _ = parse_case(case)
    state = read_any_deepspeed(ckpt(case) / "global_step3")
    assert (state.stage, state.precision, state.world_size) == (stage, precision, world)
    _assert_state_equals_deepspeed(state, expected(case)["at_save"])
    assert state.client_state == {"epoch": 7, "note": "from deepspeed"}
    assert state.optimizer_class == "AdamW"  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
    if stage > 0:
        reference = zero_to_fp32(case)
        for name in state.names:
            torch.testing.assert_close(state.masters[name], reference[name], rtol=0, atol=0)
    if precision == "fp16":  # DeepSpeed's dynamic scaler as zeroshard's: scale 2**8 doubled after 2 clean steps
        want_scale = expected(case)["at_save"]["loss_scale"]
        assert state.loss_scaler == {"kind": "dynamic", "scale": want_scale, "iteration": 3,
                                     "last_overflow_iteration": -1, "hysteresis_left": 1}


def test_reads_universal_checkpoint() -> None:
    state = read_any_deepspeed(UNIVERSAL / "global_step3")
    _assert_state_equals_deepspeed(state, expected(UNIVERSAL_FROM)["at_save"])


@pytest.mark.parametrize("case", ["s3_fp32_w2", "s2_fp16_w2"])
def test_from_deepspeed_then_to_fp32_equals_zero_to_fp32(case: str, tmp_path) -> None:
    tag_dir = from_deepspeed(ckpt(case), tmp_path / "zs")
    assert tag_dir == tmp_path / "zs" / "global_step3"
    full = consolidate_fp32(tmp_path / "zs")
    reference = zero_to_fp32(case)
    for name, value in reference.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0)
    assert list(full) == ["scale", "inp.weight", "inp.bias", "norm.weight", "norm.bias", "mid.weight", "mid.bias",
                          "out.weight", "out.bias"]  # the model's state_dict order
    back = read_zeroshard(tmp_path / "zs")
    _assert_state_equals_deepspeed(back, expected(case)["at_save"])
