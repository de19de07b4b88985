"""DeepSpeed 0.19.8's Muon state (MuonWithAuxAdam at ZeRO-2, fp32, one rank: fixture
s2_fp32_w1_muon) read, resumed and written back; the reference is what DeepSpeed itself read from
its run (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`: momentum_buffer on the
matrices, exp_avg / exp_avg_sq on the auxiliary AdamW's parameters) and DeepSpeed's zero_to_fp32.

Tolerances: reading, converting and loading only move elements: 0. After M more steps on
zeroshard against DeepSpeed's own K+M run, the two engines' Newton-Schulz differ (both bf16 on
the CPU, different kernels; DeepSpeed against itself resumed already differs by 1.6e-5): measured
max abs differences 7.8e-5 on the masters (values near 1), 1.2e-6 exp_avg, 2.6e-8 exp_avg_sq,
9.0e-7 momentum_buffer, 1.2e-5 relative on the losses; tested at about 3x those (AFTER_ATOL, loss
rtol 5e-5). The fixture trains unclipped: DeepSpeed's ZeRO-2 clips on the norm of the
orthogonalized update, zeroshard on the gradient's (docs/muon.md), which is not a checkpoint
matter. The way back (DeepSpeed resuming a converted zeroshard checkpoint) is recorded by
regenerate.py in roundtrip.json: bitwise right after DeepSpeed's load.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.checkpoint.deepspeed_fixtures import FIXTURES, ckpt, expected, zero_to_fp32
from tests.unit.checkpoint.test_deepspeed_resume import engine_for, train
from zeroshard.checkpoint.base import CheckpointError
from zeroshard.checkpoint.deepspeed.convert import from_deepspeed, to_deepspeed
from zeroshard.checkpoint.deepspeed.read_ds import read_deepspeed
from zeroshard.checkpoint.deepspeed.unpickle import load_pt
from zeroshard.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from zeroshard.zero.full_tensors import safe_get_full_fp32_param, safe_get_full_optimizer_state

CASE = "s2_fp32_w1_muon"
MATRICES = ["inp.weight", "mid.weight", "out.weight"]
KINDS = ("fp32", "exp_avg", "exp_avg_sq", "momentum_buffer")
AFTER_ATOL = {"fp32": 2.5e-4, "exp_avg": 4e-6, "exp_avg_sq": 1e-7, "momentum_buffer": 3e-6}


def _snapshot(engine) -> dict:
    out: dict = {k: {} for k in KINDS}
    for name, p in engine.module.named_parameters():
        out["fp32"][name] = safe_get_full_fp32_param(p).float()
        for key in ("momentum_buffer",) if name in MATRICES else ("exp_avg", "exp_avg_sq"):
            out[key][name] = safe_get_full_optimizer_state(p, key).float()
    return out


def _assert_same(got: dict, want: dict, atol: dict[str, float] | None = None) -> None:
    for kind in KINDS:
        assert sorted(got[kind]) == sorted(want[kind]), kind
        for name, value in want[kind].items():
            tol = (atol or {}).get(kind, 0.0)
            torch.testing.assert_close(got[kind][name], value, rtol=0, atol=tol, msg=f"{kind} of {name}")


def _portable_snapshot(state) -> dict:
    out: dict = {k: {} for k in KINDS}
    for name in state.names:
        out["fp32"][name] = state.masters[name]
        for key, value in state.optimizer_state[name].items():
            out[key][name] = value.float()
    return out


def test_reader_gives_deepspeeds_muon_state() -> None:
    want = expected(CASE)["at_save"]
    assert sorted(want["momentum_buffer"]) == MATRICES  # the fixture holds what it should
    state = read_deepspeed(ckpt(CASE) / "global_step3")
    _assert_same(_portable_snapshot(state), want)
    assert state.optimizer_class == "Muon"
    assert [h["use_muon"] for h in state.hyper] == [True, False]
    assert state.steps == [None, want["step"]]  # Muon keeps no step; its AdamW does
    assert [h["lr"] for h in state.hyper] == want["lr"]


def test_zeroshard_resumes_deepspeeds_muon_run() -> None:
    want = expected(CASE)
    engine = engine_for(2, "fp32", 1, "Muon")
    _, client_state = engine.load_checkpoint(str(ckpt(CASE)))
    assert client_state == {"epoch": 7, "note": "from deepspeed"}
    assert engine.global_steps == want["at_save"]["global_steps"]
    _assert_same(_snapshot(engine), want["at_save"])
    torch.testing.assert_close(train(engine, "fp32", 1), want["losses_after"], rtol=5e-5, atol=0)
    _assert_same(_snapshot(engine), want["after"], AFTER_ATOL)
    assert engine.global_steps == want["after"]["global_steps"]


def test_converted_and_written_back_is_deepspeeds_layout(tmp_path) -> None:
    """from-deepspeed then to-deepspeed: the optimizer file holds DeepSpeed's own tensors in
    DeepSpeed's order (MuonWithAuxAdam sorts its matrices largest first), bitwise."""
    from_deepspeed(ckpt(CASE), tmp_path / "zs")
    back = to_deepspeed(tmp_path / "zs", tmp_path / "ds", stage=2, world_size=1)
    name = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    ours = load_pt(back / name)["optimizer_state_dict"]
    theirs = load_pt(ckpt(CASE) / "global_step3" / name)["optimizer_state_dict"]
    for a, b in zip(ours["single_partition_of_fp32_groups"], theirs["single_partition_of_fp32_groups"], strict=True):
        assert torch.equal(a, b)
    for g in (0, 1):
        mine, ds = ours["base_optimizer_state"]["state"][g], theirs["base_optimizer_state"]["state"][g]
        assert sorted(mine) == sorted(ds)
        for key, value in ds.items():
            assert torch.equal(mine[key], value) if isinstance(value, torch.Tensor) else float(mine[key]) == value
    _assert_same(_portable_snapshot(read_deepspeed(back)), expected(CASE)["at_save"])


def test_deepspeed_resumed_the_written_back_checkpoint() -> None:
    """What regenerate.py recorded when DeepSpeed 0.19.8 loaded `to-deepspeed`'s output of a
    zeroshard engine's save of this fixture and trained M steps."""
    result = json.loads((FIXTURES / "roundtrip.json").read_text())[CASE]
    assert result["loaded_vs_saved_max_abs"] == 0.0
    assert result["losses"] == result["deepspeed_losses"]
    assert result["after_m_steps_vs_deepspeed_max_abs"] < 1e-4  # DeepSpeed's own Newton-Schulz, rerun
    assert result["global_steps"] == 5


def test_zero_to_fp32_of_the_muon_checkpoint() -> None:
    want = zero_to_fp32(CASE)
    got = get_fp32_state_dict_from_zero_checkpoint(ckpt(CASE))
    assert list(got) == list(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_two_rank_layout_reads_back(tmp_path) -> None:
    """to-deepspeed at world 2 (not run against DeepSpeed: its own safe_get_full_optimizer_state
    cannot read a momentum_buffer there, see the migration guide): each rank holds the whole
    momentum of every matrix its partition touches, and reading the files gives DeepSpeed's state."""
    from_deepspeed(ckpt(CASE), tmp_path / "zs")
    back = to_deepspeed(tmp_path / "zs", tmp_path / "ds", stage=1, world_size=2)
    # 1,600 matrix elements in mid (1,024), inp (384), out (192): rank 0 has [0, 800) = mid,
    # rank 1 [800, 1600) = the rest of mid, inp and out.
    sizes = [load_pt(back / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
             ["base_optimizer_state"]["state"][0]["momentum_buffer"].numel() for r in (0, 1)]
    assert sizes == [1024, 1600]
    state = read_deepspeed(back)
    assert (state.stage, state.world_size) == (1, 2)
    _assert_same(_portable_snapshot(state), expected(CASE)["at_save"])


@pytest.mark.parametrize("stage", [0, 3])
def test_muon_outside_stages_1_2_is_refused(tmp_path, stage: int) -> None:
    from_deepspeed(ckpt(CASE), tmp_path / "zs")
    with pytest.raises(CheckpointError, match=f"Muon state at stage {stage}.*--stage 1 or 2"):
        to_deepspeed(tmp_path / "zs", tmp_path / "ds", stage=stage)
    assert not (tmp_path / "ds").exists()
