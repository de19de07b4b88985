"""Stage 3's schedule on gloo: prefetch always reaches the next unit; gradient reductions
of units whose parameters are used differently on each rank (a data-dependent branch) are
issued in the same order relative to the all-gathers on every rank (issue 14)."""

from __future__ import annotations

import torch

from tests.dist.scenarios.common import Case
from tests.dist.scenarios.gpu_path import autocast_copies, branch_run, direct_vs_staged, prefetch_order

TIMEOUT_S = 300


def test_stage3_prefetches_the_next_unit_even_beyond_the_bucket_size(dist_pool) -> None:
    """stage3_prefetch_bucket_size=1 (every unit exceeds it): at the end of block i's forward
    the next block's all-gather is already issued, so the recorder has seen the root's
    gathers plus those of blocks 0..i+1."""
    for result in dist_pool(2).run(prefetch_order, 1, timeout=TIMEOUT_S):
        seen = result["seen"]
        assert len(seen) == len(result["block_flats"]) - 1, result
        for entry in seen:
            i = entry["block"]
            assert entry["next_started"], result
            expected = result["root_flats"] + sum(result["block_flats"][: i + 2])
            assert entry["gathers"] == expected, result


def test_stage3_data_dependent_branch_matches_stage0(dist_pool) -> None:
    """Rank 0 uses each block's `a` and `b`, rank 1 only `a`; reduce buckets of 64 elements go on the
    wire during backward. Stages 2 and 3 end with the masters of stage 0 (which reduces only
    at the end of backward), bitwise on gloo (same bucket layout and summation order), and
    with the same losses; a mis-ordered collective would pair a reduce-scatter with an
    all-gather (an error or a timeout of this test, never a silent pass)."""
    for per_rank in dist_pool(2).run(branch_run, (0, 2, 3), timeout=TIMEOUT_S):
        for stage in (2, 3):
            assert per_rank[stage]["losses"] == per_rank[0]["losses"], (stage, per_rank)
            for name, value in per_rank[0]["masters"].items():
                torch.testing.assert_close(per_rank[stage]["masters"][name], value, rtol=0, atol=0, msg=name)


def test_reducing_straight_from_the_local_gradient_is_bitwise_the_staged_path(dist_pool) -> None:
    """reduce_bucket_size=1: every flat fills a bucket alone, so (where safe) its local gradient
    is the collective's input, no staging copy. The masters after every step and the losses
    are bitwise those of the same run with every flat staged, at every stage, with gradient
    accumulation (stages 0-1 reduce in place only at the boundary) and in bf16."""
    cases = [
        Case(stage=stage, mode=mode, ga=ga, keep=("master",), extra={"zero_optimization": {"reduce_bucket_size": 1}})
        for stage in (0, 1, 2, 3) for mode, ga in (("fp32", 2), ("bf16", 1))
    ]
    for per_rank in dist_pool(2).run(direct_vs_staged, cases, timeout=TIMEOUT_S):
        for case, runs in zip(cases, per_rank, strict=True):
            assert runs["direct"]["direct"] > 0, case.label  # the direct path ran
            assert runs["staged"]["direct"] == 0, case.label
            assert runs["direct"]["losses"] == runs["staged"]["losses"], case.label
            for step, (a, b) in enumerate(zip(runs["direct"]["master"], runs["staged"]["master"], strict=True)):
                for name in a:
                    assert torch.equal(a[name], b[name]), (case.label, step, name)


def test_autocast_weight_copies_do_not_shrink_at_stage3_and_are_estimated(dist_pool) -> None:
    """torch_autocast(bf16) on 2 ranks: the bf16 casts of the Linear weights that autograd
    keeps for backward hold every weight, whole, on each rank, at stage 3 as at stage 0 (not
    1/W); the estimate's autocast_weight_copies bounds them: all safe parameters in bf16, the
    gap being the biases (cast, not saved)."""
    for stage in (0, 3):
        for result in dist_pool(2).run(autocast_copies, stage, timeout=TIMEOUT_S):
            assert result["saved_copy_bytes"] == result["weight_bytes_bf16"], (stage, result)
            assert result["estimate"] == 2 * result["safe_numel"], (stage, result)
            assert result["estimate"] - result["saved_copy_bytes"] == 2 * (4 * 16 + 1), (stage, result)
