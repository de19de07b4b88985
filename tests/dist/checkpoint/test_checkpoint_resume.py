"""Resume is bit-exact on the same world size: train k steps, save, load into a fresh engine,
continue; parameters, optimizer state, loss scale, counters, lr and the next losses equal the
uninterrupted run bit for bit, for every stage and precision mode.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist.checkpoint.test_checkpoint_helpers import (
    assert_snapshots_equal,
    make_engine,
    snapshot,
    train,
)

SAVE_AT, CONTINUE = 3, 3


def _shared_dir(path: str) -> str:
    """Every rank uses rank 0's directory name (pytest gives each test its own tmp_path)."""
    box = [path]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _rng_states() -> tuple:
    numpy_state = np.random.get_state()
    return (torch.get_rng_state().tolist(), random.getstate(), numpy_state[1].tolist(), numpy_state[2:])


def resume_is_bitexact(stage: int, mode: str, ckpt_dir: str, dropout: float = 0.1, optimizer: str = "AdamW") -> dict:
    ckpt_dir = _shared_dir(ckpt_dir)
    uninterrupted = make_engine(stage, mode, seed=0, dropout=dropout, optimizer=optimizer)
    train(uninterrupted, 0, SAVE_AT)
    uninterrupted.save_checkpoint(ckpt_dir, client_state={"note": "resume", "step": SAVE_AT})
    at_save = snapshot(uninterrupted)
    rng_at_save = _rng_states()
    expected_losses = train(uninterrupted, SAVE_AT, SAVE_AT + CONTINUE)
    expected = snapshot(uninterrupted)

    # Other initial weights and RNG state: the load must overwrite all of it.
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    resumed = make_engine(stage, mode, seed=1, dropout=dropout, optimizer=optimizer)
    path, client_state = resumed.load_checkpoint(ckpt_dir)
    assert path.endswith(f"global_step{SAVE_AT}"), path
    assert client_state == {"note": "resume", "step": SAVE_AT}, client_state
    assert _rng_states() == rng_at_save, "RNG state (torch, random, numpy) not restored"
    assert_snapshots_equal(at_save, snapshot(resumed), f"stage {stage} {mode}: right after load")
    losses = train(resumed, SAVE_AT, SAVE_AT + CONTINUE)
    assert losses == expected_losses, f"stage {stage} {mode}: losses {losses} vs {expected_losses}"
    assert_snapshots_equal(expected, snapshot(resumed), f"stage {stage} {mode}: after {CONTINUE} more steps")
    return {"losses": losses, "loss_scale": resumed.loss_scale, "skipped": resumed.skipped_steps}


MATRIX = [(stage, mode) for stage in (0, 1, 2, 3) for mode in ("fp32", "bf16", "fp16", "autocast")]
# bf16 master weights (with bf16 or fp32 optimizer state) at the two layouts of masters:
# whole buffer (stage 0) and shard (stage 3).
MATRIX += [(stage, mode) for stage in (0, 3) for mode in ("bf16_master", "bf16_master_fp32_state")]


@pytest.mark.parametrize("stage,mode", MATRIX)
def test_resume_bitexact_world2(dist_pool, tmp_path, stage: int, mode: str) -> None:
    results = dist_pool(2).run(resume_is_bitexact, stage, mode, str(tmp_path), timeout=120)
    assert results[0]["losses"] == results[1]["losses"]
    if mode == "fp16":
        # The scale moved during the run (overflow halvings / window doublings) and came back exactly.
        assert results[0]["loss_scale"] != 2.0**10 or results[0]["skipped"] > 0


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_bitexact_sgd_momentum(dist_pool, tmp_path, stage: int) -> None:
    """SGD keeps one state tensor (momentum_buffer) and no step counter."""
    dist_pool(2).run(resume_is_bitexact, stage, "bf16", str(tmp_path), optimizer="SGD", timeout=120)


def resume_every_stage(mode: str, ckpt_dir: str) -> list[dict]:
    return [resume_is_bitexact(stage, mode, f"{ckpt_dir}/stage{stage}") for stage in (0, 1, 2, 3)]


@pytest.mark.parametrize("world_size,mode", [(1, "bf16"), (3, "fp32"), (3, "fp16")])
def test_resume_bitexact_world1_and_3(dist_pool, tmp_path, world_size: int, mode: str) -> None:
    dist_pool(world_size).run(resume_every_stage, mode, str(tmp_path), timeout=240)
