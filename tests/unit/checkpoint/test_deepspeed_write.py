"""`zeroshard to-deepspeed`: the files equal in layout what DeepSpeed 0.19.8 itself wrote, and read
back to the same state (CI has no DeepSpeed; regenerate.py loads these files into the real
DeepSpeed and records the result in tests/fixtures/deepspeed/roundtrip.json)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.checkpoint.deepspeed_fixtures import CASES, FIXTURES, ckpt, expected
from tests.unit.checkpoint.test_deepspeed_read import _assert_state_equals_deepspeed
from zeroshard.checkpoint.deepspeed.convert import from_deepspeed, read_any_deepspeed, to_deepspeed
from zeroshard.checkpoint.deepspeed.unpickle import StandIn, load_pt
from zeroshard.cli import main


def _structure(value, path: str = "") -> dict[str, str]:
    """Every leaf of a loaded DeepSpeed file: its path -> its type (and a tensor's dtype and shape)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_structure(item, f"{path}/{key}"))
        return out or {path: "{}"}
    if isinstance(value, (list, tuple)):
        out = {}
        for i, item in enumerate(value):
            out.update(_structure(item, f"{path}[{i}]"))
        return out or {path: type(value).__name__}
    if isinstance(value, torch.Tensor):
        return {path: f"tensor {value.dtype} {list(value.shape)}"}
    if isinstance(value, StandIn):
        return {path: value.ds_class, **_structure(value.fields, path + ".")}
    return {path: type(value).__name__}


# Keys DeepSpeed writes whose value zeroshard does not carry over: its own config dict (zeroshard
# writes the config it was given, same keys at top level) is compared by its keys only.
_SKIP = ("/ds_config/",)


@pytest.mark.parametrize("case", CASES)
def test_to_deepspeed_writes_deepspeeds_layout(case: str, tmp_path) -> None:
    from_deepspeed(ckpt(case), tmp_path / "zs")
    written = to_deepspeed(tmp_path / "zs", tmp_path / "ds")
    original = ckpt(case) / "global_step3"
    assert sorted(p.name for p in written.iterdir()) == sorted(p.name for p in original.iterdir())
    assert (tmp_path / "ds" / "latest").read_text() == "global_step3"
    for theirs in original.iterdir():
        want, got = _structure(load_pt(theirs)), _structure(load_pt(written / theirs.name))
        want = {k: v for k, v in want.items() if not any(s in k for s in _SKIP)}
        got = {k: v for k, v in got.items() if not any(s in k for s in _SKIP)}
        assert got == want, f"{theirs.name}: {set(got.items()) ^ set(want.items())}"
    _assert_state_equals_deepspeed(read_any_deepspeed(written), expected(case)["at_save"])
    assert read_any_deepspeed(written).client_state == {"epoch": 7, "note": "from deepspeed"}


def test_to_deepspeed_at_another_stage_and_world_size(tmp_path) -> None:
    """A 1-rank ZeRO-2 checkpoint written for 2 ranks at stage 3, and for 3 ranks at stage 1."""
    from_deepspeed(ckpt("s2_fp32_w1"), tmp_path / "zs")
    for stage, world in ((3, 2), (1, 3)):
        out = to_deepspeed(tmp_path / "zs", tmp_path / f"ds{stage}", stage=stage, world_size=world)
        state = read_any_deepspeed(out)
        assert (state.stage, state.world_size) == (stage, world)
        _assert_state_equals_deepspeed(state, expected("s2_fp32_w1")["at_save"])


def test_deepspeed_resumed_what_to_deepspeed_wrote() -> None:
    """The record regenerate.py made in DeepSpeed's own environment: DeepSpeed 0.19.8 loaded each
    converted fixture and trained M steps; bitwise DeepSpeed's uninterrupted run where recorded so."""
    record = json.loads((FIXTURES / "roundtrip.json").read_text())
    assert record["deepspeed"] == "0.19.8"
    for case in CASES:
        entry = record[case]
        assert entry["loaded_vs_saved_max_abs"] == 0.0, case
        assert entry["after_m_steps_vs_deepspeed_max_abs"] == 0.0, case
        assert entry["losses"] == entry["deepspeed_losses"] == expected(case)["losses_after"], case


def test_commands(tmp_path, capsys) -> None:
    assert main(["from-deepspeed", str(ckpt("s3_fp32_w2")), str(tmp_path / "zs")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'zs' / 'global_step3'}"
    assert main(["to-deepspeed", str(tmp_path / "zs"), str(tmp_path / "ds"), "--stage", "2"]) == 0
    assert read_any_deepspeed(tmp_path / "ds" / "global_step3").stage == 2
    assert main(["from-deepspeed", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 1
    assert "not a DeepSpeed checkpoint" in capsys.readouterr().err
    assert main(["to-deepspeed", str(tmp_path / "zs"), str(tmp_path / "ds")]) == 1  # nothing is overwritten
    assert "already exists" in capsys.readouterr().err
