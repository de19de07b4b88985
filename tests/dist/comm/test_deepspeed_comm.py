"""`zeroshard.comm` answers DeepSpeed's `deepspeed.comm` calls as torch.distributed does (issue
23, item 2): on 2 gloo ranks, every call is compared with the same call on torch.distributed.
Inputs are small integers in fp32, so every result is exact: the tolerance is zero."""

from __future__ import annotations

import torch

from tests.dist.scenarios import deepspeed_comm

WORLD = 2


def test_rank_queries_match_torch(dist_pool) -> None:
    for rank, got in enumerate(dist_pool(WORLD).run(deepspeed_comm.queries, timeout=120)):
        assert got["is_initialized"] is True and got["is_available"] is True
        for key in ("rank", "world_size", "rank_in_sub", "rank_in_new_group", "rank_in_zs_group",
                    "size_of_zs_group", "global_rank_1", "global_rank_zs", "all_ranks", "all_ranks_zs"):
            ours, theirs = got[key]
            assert ours == theirs, (rank, key, ours, theirs)
        assert got["rank"][0] == rank and got["rank_in_sub"][0] == (0 if rank == WORLD - 1 else -1)
        assert got["local_rank"] == rank  # the pool's workers are one machine: LOCAL_RANK = RANK


def test_collectives_match_torch(dist_pool) -> None:
    results = dist_pool(WORLD).run(deepspeed_comm.collectives_against_torch, timeout=120)
    for rank, got in enumerate(results):
        assert got.pop("recorded") == 0, "DeepSpeed-style calls are the user's, not the engine's: not recorded"
        for key, (ours, theirs) in got.items():
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=lambda m, k=key, r=rank: f"{k} rank {r}: {m}")
    # And one absolute check, so agreement is not agreement on a wrong answer: the sum of
    # arange(6) + 10 (r + 1) over 2 ranks.
    torch.testing.assert_close(results[0]["all_reduce_sum"][0], torch.arange(6.0) * 2 + 30, rtol=0, atol=0)


def test_init_distributed_keeps_an_existing_group(dist_pool) -> None:
    assert dist_pool(WORLD).run(deepspeed_comm.init_distributed_keeps_the_group, timeout=120) == [True, True]
