"""An AutoEP layer's `ep_group` is a torch ProcessGroup (issue 30 item 6): DeepSpeed 0.19's
AutoEPMoELayer keeps the torch group its `groups._get_expert_parallel_group` returns, and user
code passes it to torch.distributed. zeroshard's own collectives keep the layer's zeroshard Group
(`expert_group`). On 2 ranks, autoep_size 2, a tiny Mixtral built from a config."""

from __future__ import annotations

import pytest

from tests.dist.scenarios.autoep_torch_group import torch_group_case

pytest.importorskip("transformers")

# fp32, same products summed in another order (the swapped experts' fused matmuls and route
# sums), as tests/dist/moe/test_autoep.py's FORWARD_TOL: observed <= 3e-8 there.
FORWARD_TOL = 1e-5


@pytest.fixture(scope="module")
def results(dist_pool):
    return dist_pool(2).run(torch_group_case, "mixtral", timeout=600)


def test_ep_group_is_a_torch_process_group(results):
    for rank, r in enumerate(results):
        assert r["is_process_group"], rank
        assert r["world_size"] == 2 and r["group_rank"] == rank and r["ranks"] == [0, 1], (rank, r)
        assert r["all_reduce"] == 3.0, (rank, r)  # 1 + 2: torch's all_reduce ran on it
        assert r["same_group_everywhere"], rank


def test_the_layer_collectives_keep_their_zeroshard_group(results):
    for rank, r in enumerate(results):
        assert r["expert_group"] == (True, (0, 1)), (rank, r)
        bound = FORWARD_TOL * max(1.0, r["logit_scale"])
        assert r["diff_before"] <= bound, (rank, r)
        assert r["diff_after"] <= bound, (rank, r)
