"""`zeroshard to-fp32` and the alias's `deepspeed.utils.zero_to_fp32` functions on checkpoints
DeepSpeed 0.19.8 wrote: the reference is DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint`
on the same fixture (zero_to_fp32.pt, recorded by regenerate.py). Only elements move, so the
comparison is exact (tolerance 0), names and their order included.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.unit.checkpoint.deepspeed_fixtures import CASES, UNIVERSAL, UNIVERSAL_FROM, ckpt, zero_to_fp32
from zeroshard.cli import main as cli_main
from zeroshard.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

ZERO_CASES = [c for c in CASES if not c.startswith("s0_")]  # DeepSpeed's zero_to_fp32 reads stages 1-3


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], ordered: bool = True) -> None:
    assert list(got) == list(want) if ordered else sorted(got) == sorted(want)  # safetensors sorts names
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", ZERO_CASES)
def test_state_dict_equals_deepspeeds_zero_to_fp32(case: str) -> None:
    _assert_same(get_fp32_state_dict_from_zero_checkpoint(str(ckpt(case))), zero_to_fp32(case))


def test_tag_and_universal_checkpoint() -> None:
    case = "s2_bf16_w2"
    _assert_same(get_fp32_state_dict_from_zero_checkpoint(ckpt(case), tag="global_step3"), zero_to_fp32(case))
    _assert_same(get_fp32_state_dict_from_zero_checkpoint(UNIVERSAL), zero_to_fp32(UNIVERSAL_FROM))


def test_cli_convert_and_load(tmp_path, capsys) -> None:
    case = "s3_fp32_w2"
    want = zero_to_fp32(case)
    out = tmp_path / "weights.safetensors"
    assert cli_main(["to-fp32", str(ckpt(case)), str(out)]) == 0
    _assert_same(load_file(str(out)), want, ordered=False)
    path = convert_zero_checkpoint_to_fp32_state_dict(ckpt(case), tmp_path / "hf", safe_serialization=True)
    _assert_same(load_file(str(path)), want, ordered=False)
    from tests.unit.checkpoint.deepspeed_fixtures import fixture_model

    model = load_state_dict_from_zero_checkpoint(fixture_model().make_model(), ckpt(case))
    _assert_same({k: v for k, v in model.state_dict().items()}, want)


def test_not_a_checkpoint_names_the_cause(tmp_path) -> None:
    (tmp_path / "latest").write_text("global_step9")
    (tmp_path / "global_step9").mkdir()
    with pytest.raises(Exception, match="global_step9"):
        get_fp32_state_dict_from_zero_checkpoint(tmp_path)
