"""Preemption (issue 27 items 1 and 6): a real signal to one rank, at a chosen point of the
loop, stops every rank at the same step with one complete checkpoint and the configured exit
status; that checkpoint equals an uninterrupted run stopped there, bit for bit (same world
size, so no tolerance). Rank-side code: tests/dist/scenarios/preemption.py.
"""

from __future__ import annotations

import pytest

from tests.dist.scenarios import preemption as scenarios

EXIT = 143  # zeroshard.config.preemption.DEFAULT_EXIT_CODE

# (kind, stage, mode, step every rank stops at)
CASES = [
    ("mid_step", 0, "fp32", 3),
    ("mid_step", 1, "bf16", 3),
    ("mid_step", 2, "fp16", 3),
    ("mid_step", 3, "fp32", 3),
    ("mid_save", 2, "fp32", 3),
    ("mid_async_save", 3, "bf16", 3),
    ("mid_eval", 3, "bf16", 2),
    ("mid_eval_no_poll", 3, "fp32", 3),
    ("two_signals", 1, "fp32", 3),
    ("before_first_step", 2, "bf16", 1),
    ("before_first_step_poll", 0, "fp32", 0),
]


@pytest.mark.parametrize(("kind", "stage", "mode", "stop"), CASES, ids=[f"{c[0]}-s{c[1]}-{c[2]}" for c in CASES])
def test_a_signal_to_one_rank_stops_every_rank_with_one_checkpoint(dist_pool, tmp_path, kind, stage, mode, stop):
    ranks = dist_pool(2).run(scenarios.preempted_run, kind, stage, mode, str(tmp_path), timeout=120)
    tag = tmp_path / f"global_step{stop}"
    for rank, seen in enumerate(ranks):
        assert seen["code"] == EXIT, f"rank {rank}: {seen}"
        assert seen["stopped_at"] == stop, f"rank {rank}: {seen}"
        assert seen["saved"] == str(tag) and seen["resumed"] == str(tag), f"rank {rank}: {seen}"
    assert (tmp_path / "latest").read_text().strip() == tag.name
    expected = {"latest", tag.name} | ({"user"} if "save" in kind else set())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    if kind == "mid_eval":
        assert [seen["evaluated"] for seen in ranks] == [0, 0]  # both left at the same batch
    if kind == "mid_eval_no_poll":
        assert [seen["evaluated"] for seen in ranks] == [3, 3]
    if kind == "two_signals":
        assert [seen["signals"] for seen in ranks] == [2, 1]


def test_a_group_created_before_initialize_is_adopted_and_each_rank_writes_its_own_files(dist_pool, tmp_path):
    ranks = dist_pool(2).run(scenarios.adopted_group_writes_own_files, str(tmp_path), timeout=120)
    assert [r["same_group"] for r in ranks] == [True, True]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert ranks[0]["written"] == ["rank_00000.safetensors", "module_extras.safetensors"]
    assert ranks[1]["written"] == ["rank_00001.safetensors"]


@pytest.mark.parametrize(("stage", "mode"), [(0, "fp16"), (3, "bf16")])
def test_the_stop_vote_costs_no_collective(dist_pool, stage, mode):
    """The step with a vote issues exactly the collectives of a step without one: the vote is one
    more element of the norm's all-reduce (2 + 3 * world size elements), and after that step
    every rank knows; after the step before it none did."""
    ranks = dist_pool(2).run(scenarios.vote_rides_the_step_all_reduce, stage, mode, timeout=120)
    for rank, seen in enumerate(ranks):
        without, with_vote = seen["logs"]
        assert without == with_vote, f"rank {rank}: {without} vs {with_vote}"
        assert ("all_reduce", "norm", 2 + 3 * 2) in with_vote, with_vote
        assert seen["agreed"] == [False, True], f"rank {rank}: {seen}"
