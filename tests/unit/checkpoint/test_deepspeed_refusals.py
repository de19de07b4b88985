"""Damaged or hostile DeepSpeed checkpoints are refused with an error that names the cause and the fix.

The crafted files are made here from the committed DeepSpeed fixtures (a copy with one file
replaced, cut or removed), so each differs from a real DeepSpeed checkpoint in one way only.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.unit.checkpoint.deepspeed_fixtures import ckpt
from tests.unit.checkpoint.test_deepspeed_resume import engine_for
from zeroshard.checkpoint import CheckpointError
from zeroshard.checkpoint.deepspeed.convert import from_deepspeed
from zeroshard.checkpoint.deepspeed.unpickle import load_pt


def _copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(ckpt(case), dst)
    return dst


class _RunsCode:
    """Unpickles as a call of os.system: what a hostile checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_naming_a_callable_outside_the_allow_list(tmp_path) -> None:
    root = _copy("s2_fp32_w1", tmp_path)
    model_file = root / "global_step3" / "mp_rank_00_model_states.pt"
    table = load_pt(model_file)
    marker = tmp_path / "code_ran"
    table["epoch"] = _RunsCode(marker)  # client state is where a user's own object would sit
    torch.save(table, model_file)
    with pytest.raises(CheckpointError) as info:
        from_deepspeed(root, tmp_path / "out")
    message = str(info.value)
    assert f"{os.system.__module__}.system" in message and str(model_file) in message
    assert "allow_pickle=True" in message
    engine = engine_for(2, "fp32", 1)
    with pytest.raises(CheckpointError, match="which is not a type a DeepSpeed checkpoint holds"):
        engine.load_checkpoint(str(root))
    assert not marker.exists()
    assert engine.global_steps == 0  # nothing loaded


def test_allow_pickle_is_the_explicit_escape(tmp_path) -> None:
    root = _copy("s2_fp32_w1", tmp_path)
    model_file = root / "global_step3" / "mp_rank_00_model_states.pt"
    table = load_pt(model_file)
    table["epoch"] = pickle.loads(pickle.dumps(Path("/data/shard-7")))  # a pathlib object: not allow-listed
    torch.save(table, model_file)
    with pytest.raises(CheckpointError, match="PosixPath"):
        load_pt(model_file)
    assert load_pt(model_file, allow_pickle=True)["epoch"] == Path("/data/shard-7")
    engine = engine_for(2, "fp32", 1)
    _, client_state = engine.load_checkpoint(str(root), allow_pickle=True)
    assert client_state == {"epoch": Path("/data/shard-7"), "note": "from deepspeed"}


def test_truncated_file(tmp_path) -> None:
    root = _copy("s1_fp32_w2_adam", tmp_path)
    victim = root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        from_deepspeed(root, tmp_path / "out")
    assert str(victim) in str(info.value) and "Copy the file again" in str(info.value)


def test_missing_rank_file(tmp_path) -> None:
    root = _copy("s3_fp32_w2", tmp_path)
    (root / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError) as info:
        from_deepspeed(root, tmp_path / "out")
    message = str(info.value)
    assert "rank(s) [1] missing (zero_pp_rank_1_mp_rank_00_optim_states.pt)" in message
    assert "saved by 2 data-parallel ranks" in message and "Copy the whole tag directory" in message


def test_world_size_that_does_not_match_the_files(tmp_path) -> None:
    """Optimizer files of a 1-rank save under model states that say 2 ranks, and a stray third file."""
    root = _copy("s2_bf16_w2", tmp_path)
    tag = root / "global_step3"
    stray = tag / "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"
    shutil.copy(tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", stray)
    with pytest.raises(CheckpointError, match=r"for rank\(s\) \[2\], but the model states say the run had 2"):
        from_deepspeed(root, tmp_path / "out")
    stray.unlink()
    one_rank = ckpt("s1_bf16_w1") / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    shutil.copy(one_rank, tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match=r"partition_count \[1\] differs from the model states' dp_world_size 2"):
        from_deepspeed(root, tmp_path / "out2")
