"""Checkpoints of an MoE model (zeroshard/checkpoint/names.py): experts saved by global index.

Saved at world 4 with ep_size 2 (stage 1) after one step; loaded
* by the same configuration: resuming equals not stopping (bitwise, fp32: the same
  operations on the same values, the RNG state restored);
* at ep_size 4 / stage 3 and ep_size 1 / stage 0 on 4 ranks, and at ep_size 2 / stage 2 on
  2 ranks: every master and AdamW moment equals what was saved (bitwise: a copy), and on
  4 ranks the next step equals the uninterrupted run within the fp32 tolerance of
  tests/dist/moe/test_moe_engine.py (expert gradients summed in another grouping);
* without a process group (`consolidate_fp32`): one tensor per global expert.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.moe_engine import (
    EngineCase,
    build_model,
    global_names,
    load_then_continue,
    save_then_continue,
)
from zeroshard.checkpoint.export import consolidate_fp32

TIMEOUT_S = 600
FP32 = {"atol": 1e-6, "rtol": 1e-5}
SAVED = EngineCase(ep_size=2, stage=1)
RESHARDED = [EngineCase(4, 3), EngineCase(1, 0)]


def merged(per_rank: list[dict], key: str, what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for result in per_rank:
        for name, value in result[key][what].items():
            if name in out:
                torch.testing.assert_close(value, out[name], atol=0, rtol=0)
            out[name] = value
    return out


@pytest.fixture(scope="module")
def runs(dist_pool, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("moe-ckpt"))
    saved = dist_pool(4).run(save_then_continue, SAVED, root, timeout=TIMEOUT_S)
    resumed = dist_pool(4).run(load_then_continue, SAVED, root, timeout=TIMEOUT_S)
    resharded = [dist_pool(4).run(load_then_continue, case, root, timeout=TIMEOUT_S) for case in RESHARDED]
    world2 = dist_pool(2).run(load_then_continue, EngineCase(2, 2), root, False, timeout=TIMEOUT_S)
    return root, saved, resumed, resharded, world2


def test_resume_equals_uninterrupted(runs) -> None:
    _, saved, resumed, _, _ = runs
    for what in ("master", "exp_avg"):
        torch.testing.assert_close(merged(resumed, "loaded", what), merged(saved, "saved", what), atol=0, rtol=0)
        torch.testing.assert_close(merged(resumed, "after", what), merged(saved, "after", what), atol=0, rtol=0)


@pytest.mark.parametrize("index", range(len(RESHARDED)), ids=[c.label for c in RESHARDED])
def test_load_onto_another_ep_size_and_stage(runs, index: int) -> None:
    _, saved, _, resharded, _ = runs
    for what in ("master", "exp_avg"):
        torch.testing.assert_close(
            merged(resharded[index], "loaded", what), merged(saved, "saved", what), atol=0, rtol=0
        )
        torch.testing.assert_close(merged(resharded[index], "after", what), merged(saved, "after", what), **FP32)


def test_load_onto_another_world_size(runs) -> None:
    _, saved, _, _, world2 = runs
    for what in ("master", "exp_avg"):
        torch.testing.assert_close(merged(world2, "loaded", what), merged(saved, "saved", what), atol=0, rtol=0)


def test_consolidated_checkpoint_names_every_expert_once(runs) -> None:
    root, saved, _, _, _ = runs
    state = consolidate_fp32(root, "s1")
    expected = merged(saved, "saved", "master")
    assert set(state) == set(global_names(build_model(ep_size=1)))  # the ep_size 1 model's names
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, atol=0, rtol=0)
