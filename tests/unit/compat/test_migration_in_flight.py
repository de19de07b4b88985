"""docs/migrating-from-deepspeed.md, "Moving a run in flight": its commands run as written, on a
DeepSpeed 0.19.8 fixture (tests/fixtures/deepspeed/), and produce checkpoints that read back to
DeepSpeed's own numbers."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.unit.checkpoint.deepspeed_fixtures import UNIVERSAL, UNIVERSAL_FROM, ckpt, expected, zero_to_fp32
from zeroshard.checkpoint import consolidate_fp32
from zeroshard.checkpoint.deepspeed.convert import read_any_deepspeed
from zeroshard.cli import main

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "migrating-from-deepspeed.md"


def _commands() -> list[list[str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Moving a run in flight", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_moving_a_run_in_flight_commands(tmp_path, monkeypatch) -> None:
    shutil.copytree(ckpt(UNIVERSAL_FROM), tmp_path / "ds_ckpt")
    shutil.copytree(UNIVERSAL, tmp_path / "ds_universal")
    commands = _commands()
    assert [c[:2] for c in commands] == ([["zeroshard", "from-deepspeed"]] * 2 + [["zeroshard", "to-deepspeed"]]
                                         + [["zeroshard", "to-fp32"]])
    monkeypatch.chdir(tmp_path)
    for command in commands:  # the `zeroshard` entry point, in this process (a subprocess only adds imports)
        assert main(command[1:]) == 0, command
    want = expected(UNIVERSAL_FROM)["at_save"]["fp32"]
    for out in ("zs_ckpt", "zs_from_universal"):
        full = consolidate_fp32(tmp_path / out)
        for name, value in want.items():
            torch.testing.assert_close(full[name], value, rtol=0, atol=0)
    fp32 = load_file(str(tmp_path / "ds_fp32.safetensors"))
    assert sorted(fp32) == sorted(zero_to_fp32(UNIVERSAL_FROM))
    for name, value in zero_to_fp32(UNIVERSAL_FROM).items():  # DeepSpeed's own zero_to_fp32 output
        torch.testing.assert_close(fp32[name], value, rtol=0, atol=0)
    back = read_any_deepspeed(tmp_path / "ds_back" / "global_step3")
    assert (back.stage, back.world_size) == (2, 2)
    for name, value in want.items():
        torch.testing.assert_close(back.masters[name], value, rtol=0, atol=0)
