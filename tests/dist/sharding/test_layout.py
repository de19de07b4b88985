"""The parallel layout (zeroshard/sharding/layout.py) at world size 4 with hybrid sharding.

`zeroshard.shard_group_size = 2` on 4 ranks: each flat is sharded over {0,1} (ranks 0 and 1)
and over {2,3}, and replicated over {0,2} and {1,3}. Gradients reduce-scatter within the
shard group, then the shard is all-reduced over the replica group, so training must equal
world size 2 (micro-batch 2 instead of 1) on the same global batches, and the single-process
reference. Every collective must run on the group it belongs to.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import check_against_reference, flat_cat, reference_for, world_losses
from tests.dist.scenarios.layout import (
    bad_shard_group_size,
    checkpoint_fragments,
    hybrid_case,
    hybrid_resume,
    train_cases,
)

STAGES = (0, 1, 2, 3)
GRAD_ACCUM = (1, 2)
TIMEOUT_S = 600
WORLD = (0, 1, 2, 3)


def hybrid_cases():
    return [hybrid_case(stage, ga=ga) for ga in GRAD_ACCUM for stage in STAGES]


def plain_cases():
    """World size 2 without hybrid sharding, on the same global batches (micro 2 x 2 ranks =
    micro 1 x 4 ranks rows per micro-step)."""
    return [hybrid_case(stage, ga=ga, micro=2, hybrid=False) for ga in GRAD_ACCUM for stage in STAGES]


@pytest.fixture(scope="module")
def runs(dist_pool):
    hybrid = dist_pool(4).run(train_cases, hybrid_cases(), timeout=TIMEOUT_S)
    plain = dist_pool(2).run(train_cases, plain_cases(), timeout=TIMEOUT_S)
    return hybrid, plain


def test_hybrid_groups(runs) -> None:
    hybrid, _ = runs
    for rank, results in enumerate(hybrid):
        for result in results:
            assert result["shard_ranks"] == ((0, 1) if rank < 2 else (2, 3)), f"rank {rank}"
            assert result["replicate_ranks"] == ((0, 2) if rank % 2 == 0 else (1, 3)), f"rank {rank}"


def test_hybrid_trains_like_world_size_two(runs) -> None:
    """Parameters after each of 3 AdamW steps (clipping active) equal world size 2's.

    Tolerance: the fp32 reference tolerance (atol 1e-6, rtol 1e-5; tests/dist/reference.py):
    the same numbers are summed in another order (4 per-rank means instead of 2)."""
    hybrid, plain = runs
    for index, case in enumerate(hybrid_cases()):
        for step, (mine, theirs) in enumerate(zip(hybrid[0][index]["master"], plain[0][index]["master"], strict=True)):
            torch.testing.assert_close(
                flat_cat(mine), flat_cat(theirs), atol=1e-6, rtol=1e-5,
                msg=lambda m, s=step, c=case: f"{c.label}: step {s + 1}: {m}",
            )
        ref = reference_for(case, 4)
        check_against_reference(
            hybrid[0][index], ref, case.mode, case.settings, world_losses(hybrid, index), case.label
        )


def test_replicas_hold_the_same_shards(runs) -> None:
    """Ranks 0 and 2 (and 1 and 3) hold bitwise-equal master shards; all ranks the same full
    parameters."""
    hybrid, _ = runs
    for index, case in enumerate(hybrid_cases()):
        for a, b in ((0, 2), (1, 3)):
            for x, y in zip(hybrid[a][index]["local_masters"], hybrid[b][index]["local_masters"], strict=True):
                assert torch.equal(x, y), f"{case.label}: ranks {a} and {b} hold different shards"
        final = [flat_cat(hybrid[r][index]["master"][-1]) for r in range(4)]
        assert all(torch.equal(final[0], f) for f in final[1:]), f"{case.label}: replicas diverged"


def test_each_collective_runs_on_its_group(runs) -> None:
    """Gradients: the shard group's reduction, then the replica group's all-reduce of the
    result (half the elements after a reduce-scatter); parameters gathered within the shard
    group; the norm over the world."""
    hybrid, _ = runs
    for rank, results in enumerate(hybrid):
        shard = (0, 1) if rank < 2 else (2, 3)
        replicate = (0, 2) if rank % 2 == 0 else (1, 3)
        for case, result in zip(hybrid_cases(), results, strict=True):
            records = result["collectives"]
            label = f"{case.label} rank {rank}"
            grad_op = "all_reduce" if case.stage <= 1 else "reduce_scatter"
            on_shard = [r for r in records if r[1] == "grad" and r[2] == shard]
            on_replica = [r for r in records if r[1] == "grad" and r[2] == replicate]
            assert on_shard and on_replica, f"{label}: no gradient reduction on both groups: {records}"
            assert {r[0] for r in on_shard} == {grad_op}, label
            assert {r[0] for r in on_replica} == {"all_reduce"}, label
            per_shard = 1 if case.stage <= 1 else 2  # a reduce-scatter leaves half on each rank
            assert sum(r[3] for r in on_replica) * per_shard == sum(r[3] for r in on_shard), label
            expected = {"grad": {shard, replicate}, "param": {shard}, "full_tensor": {shard}, "norm": {WORLD}}
            for op, tag, group, _ in records:
                assert group in expected.get(tag, set()), f"{label}: {op} tag {tag!r} on group {group}"
            assert any(r[1] == "norm" for r in records), label
            if case.stage in (1, 2, 3):
                assert any(r[1] == "param" for r in records), f"{label}: no parameter gather"


def test_plain_layout_runs_every_collective_on_the_world(runs) -> None:
    _, plain = runs
    for results in plain:
        for case, result in zip(plain_cases(), results, strict=True):
            assert result["replicate_ranks"] in ((0,), (1,))
            assert {r[2] for r in result["collectives"]} == {(0, 1)}, case.label


@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_checkpoint_indexes_each_element_once(dist_pool, stage: int) -> None:
    """The index lists one replica's fragments at shard-group offsets: the checkpoint
    consolidated without a process group equals the engine's full masters, bitwise."""
    results = dist_pool(4).run(checkpoint_fragments, hybrid_case(stage), timeout=TIMEOUT_S)
    masters, consolidated = results[0]["masters"], results[0]["consolidated"]
    for name, value in masters.items():
        assert torch.equal(consolidated[name].float(), value), name


def test_shard_group_size_must_divide_the_world(dist_pool) -> None:
    messages = dist_pool(4).run(bad_shard_group_size, timeout=TIMEOUT_S)
    for message in messages:
        assert message.startswith("zeroshard.shard_group_size=3: must divide the world size 4."), message


@pytest.mark.parametrize("stage", [1, 3])
def test_hybrid_resume_is_bitexact_and_loads_unsplit(dist_pool, stage: int) -> None:
    """Resume on the same hybrid layout continues bit for bit; the checkpoint also loads into a
    plain world-4 layout with the saved masters exactly."""
    for result in dist_pool(4).run(hybrid_resume, hybrid_case(stage), timeout=TIMEOUT_S):
        assert result["plain_replicas"] == 1
        for name, value in result["saved"].items():
            assert torch.equal(result["loaded"][name], value), f"stage {stage}: {name} after load"
            assert torch.equal(result["plain_loaded"][name], value), f"stage {stage}: {name} loaded unsplit"
            assert torch.equal(result["continued"][name], result["expected"][name]), f"stage {stage}: {name} resumed"


# ---------------------------------------------------------------- expert x sequence parallelism

EP_SP_STAGES = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def ep_sp_runs(dist_pool):
    from tests.dist.scenarios.layout_ep_sp import train as train_ep_sp

    return dist_pool(4).run(train_ep_sp, EP_SP_STAGES, timeout=TIMEOUT_S)


def expected_groups(rank: int) -> dict[str, tuple[int, ...]]:
    """World 4, sequence-parallel 2, ep_size 2, written from DeepSpeed 0.19's rules:
    * EP and EDP: deepspeed/utils/groups.py `_create_expert_and_data_parallel` (its "E + D"
      path, taken by the MoE layer when the mpu is a sequence-parallel one): expert-parallel
      groups range(i * ep, (i + 1) * ep), expert-data-parallel groups range(i, world, ep).
    * SP and data: parallel_state_sp (DeepSpeed's runtime/sequence_parallel/parallel_state_sp):
      sequence groups are consecutive blocks of sp, data groups the ranks i, i + sp, ...
    * sequence-data (`_get_sequence_data_parallel_group`, what ZeRO shards dense parameters
      over): every rank; dense data (`_get_data_parallel_group`, zeroshard's value): the world.
    """
    return {
        "ep": (0, 1) if rank < 2 else (2, 3),
        "edp": (0, 2) if rank % 2 == 0 else (1, 3),
        "sp": (0, 1) if rank < 2 else (2, 3),
        "data": (0, 2) if rank % 2 == 0 else (1, 3),
        "sp_data": WORLD,
        "dense": WORLD,
    }


def test_expert_and_sequence_groups_follow_deepspeed(ep_sp_runs) -> None:
    for rank, results in enumerate(ep_sp_runs):
        want = expected_groups(rank)
        for result in results:
            seen, label = result["groups"], f"rank {rank} stage {result['stage']}"
            assert seen["one_layout"], f"{label}: the engine's layout is not the process's one layout"
            assert seen["ep"] == (want["ep"],) * 2, f"{label}: {seen['ep']}"
            assert seen["edp"] == want["edp"], f"{label}: {seen['edp']}"
            assert seen["sp"] == (want["sp"],) * 4, f"{label}: {seen['sp']}"
            assert seen["data"] == (want["data"],) * 3, f"{label}: {seen['data']}"
            assert seen["sp_data"] == (want["sp_data"],) * 2, f"{label}: {seen['sp_data']}"
            assert seen["dense_shard"] == want["dense"] and seen["dense_data"] == want["dense"], label
            assert seen["expert_flats"] == [want["edp"]], f"{label}: {seen['expert_flats']}"
            assert seen["dense_flats"] == [want["dense"]], f"{label}: {seen['dense_flats']}"


def test_expert_and_sequence_parallel_training_equals_single_process(ep_sp_runs) -> None:
    """3 SGD steps (momentum, clipping active) of an MoE + Ulysses model equal the single-process
    fp32 reference (tests/dist/scenarios/layout_ep_sp.py).

    Tolerance: atol 1e-6, rtol 1e-5 on parameters (the fp32 reference tolerance of
    tests/dist/reference.py), atol 1e-6 on losses: the same products summed in another order
    (each slice's partial sums, the all-to-alls' regrouping, the reduction over 4 ranks), a
    few fp32 ulps; a wrong group or divisor moves values by whole fractions."""
    for rank, results in enumerate(ep_sp_runs):
        for result in results:
            label = f"rank {rank} stage {result['stage']}"
            group = rank // 2  # the sample group this rank's sequence slice belongs to
            index = next(i for i, r in enumerate(results) if r is result)
            halves = [ep_sp_runs[rank - rank % 2 + i][index]["losses"] for i in range(2)]
            summed = [a + b for a, b in zip(*halves, strict=True)]  # the slices' losses sum to the group's
            torch.testing.assert_close(
                torch.tensor(summed), torch.tensor([step[group] for step in result["ref_losses"]]), atol=1e-6, rtol=0,
                msg=lambda m, s=label: f"{s}: losses: {m}",
            )
            assert result["params"].keys() <= result["ref_params"].keys(), label
            for name, value in result["params"].items():  # the dense parameters and this rank's experts
                torch.testing.assert_close(
                    value, result["ref_params"][name], atol=1e-6, rtol=1e-5,
                    msg=lambda m, s=label, n=name: f"{s}: {n}: {m}",
                )
    for index, result in enumerate(ep_sp_runs[0]):  # between them the ranks hold every expert
        held = set().union(*(runs[index]["params"].keys() for runs in ep_sp_runs))
        assert held == result["ref_params"].keys(), f"stage {result['stage']}: {held ^ result['ref_params'].keys()}"

