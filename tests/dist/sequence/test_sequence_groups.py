"""The sequence-parallel mpu (zeroshard.sequence.parallel_state_sp) and
zeroshard.groups at world size 4: sequence groups are consecutive ranks, data-parallel
groups strided, the sequence-data-parallel group is the world."""

from __future__ import annotations

from tests.dist.scenarios.sequence_groups import describe


def test_groups_at_world_size_four(dist_pool) -> None:
    for rank, out in enumerate(dist_pool(4).run(describe, [2, 4, 1], timeout=300)):
        assert out["before"] == (None, 1, 0), out["before"]
        two = out[2]
        assert two["sp"] == ((0, 1) if rank < 2 else (2, 3), 2, rank % 2), two
        assert two["dp"] == ((0, 2) if rank % 2 == 0 else (1, 3), 2, rank // 2), two
        assert two["sdp"] == ((0, 1, 2, 3), 4, rank), two
        # DeepSpeed's sequence mpu aliases get_model_parallel_* to the sequence-parallel ones.
        assert two["mp"] == ((0, 1) if rank < 2 else (2, 3), 2, rank % 2), two
        assert two["groups"] == two["sp"], two
        assert "already initialized" in two["twice"], two
        four = out[4]
        assert four["sp"] == ((0, 1, 2, 3), 4, rank), four
        assert four["dp"] == ((rank,), 1, 0), four
        one = out[1]
        assert one["sp"] == ((rank,), 1, 0) and one["dp"] == ((0, 1, 2, 3), 4, rank), one
        assert "sequence_parallel_size=3: must be a positive divisor of the world size 4" in out["bad"], out["bad"]
