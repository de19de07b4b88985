"""`param.grad` after the boundary backward (DeepSpeed users log and inspect it), 2 ranks,
gradient_accumulation_steps 2.

Stages 0 and 1 (fp32, and bf16 with bf16 accumulation; also with hybrid sharding and optimizer
offload at stage 1): every trainable parameter's `.grad` is the reduced, averaged gradient,
equal to the single-process fp32 reference's gradient of the same global batch, equal to
`safe_get_full_grad`, and a view of the flat's one gradient buffer (no second copy); zeroing
it in place makes the step a no-op for SGD without weight decay; it is None during the
accumulation's micro-steps, after the step and after `zero_grad`; the step's norm is the
reference's (the whole gradient on every rank is counted once). Stages 2-3, and bf16 with fp32
accumulation: `.grad` stays None (no whole reduced gradient of the parameter's dtype exists on
the rank; see zeroshard/grads/views.py)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import TOLERANCES, cached_reference
from tests.dist.scenarios.grad_views import GRAD_VIEW_SETTINGS

HYBRID = {"zeroshard": {"shard_group_size": 1}}  # on 2 ranks: shards of one rank, replicated over both
OFFLOAD = {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
CASES = [
    (0, "fp32", ""), (0, "bf16_accum_bf16", ""), (0, "bf16", ""),
    (1, "fp32", ""), (1, "bf16_accum_bf16", ""), (1, "bf16", ""), (1, "fp32", "offload"), (1, "fp32", "hybrid"),
    (2, "fp32", ""), (3, "fp32", ""),
]
EXTRA = {"": None, "offload": OFFLOAD, "hybrid": HYBRID}
EXPOSED = {(0, "fp32"), (0, "bf16_accum_bf16"), (1, "fp32"), (1, "bf16_accum_bf16")}
WORLD, MICRO, GA = 2, 2, 2  # the scenario's Case defaults


@pytest.fixture(scope="module")
def results(dist_pool):
    pool = dist_pool(WORLD)
    return {
        case: pool.run("tests.dist.scenarios.grad_views:grad_views", case[0], case[1], EXTRA[case[2]], timeout=300)
        for case in CASES
    }


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{m}{'-' + v if v else ''}" for s, m, v in CASES])
def test_param_grad_after_the_boundary_backward(results, case) -> None:
    stage, mode, _ = case
    per_rank = results[case]
    for out in per_rank:
        assert all(out["after_first"]), "no .grad before the boundary backward"
        assert all(out["after_step"]), "no .grad after the step"
        assert all(out["during_next"]), "no .grad during the accumulation's micro-steps"
        assert all(out["after_zero_grad"]), "zero_grad drops the views"
    if (stage, mode) not in EXPOSED:
        for out in per_rank:
            assert all(g is None for g in out["grad"].values()), case
            assert not out["exposed_again"]
        return
    # The reference: one process, the whole global batch (W x micro x GA rows), fp32 (bf16's
    # reference rounds the weights and computes in bf16, as the engine does).
    ref = cached_reference(0, 1, WORLD * MICRO * GA, mode, GRAD_VIEW_SETTINGS)
    # fp32: the same sums in another order (measured <= 2e-7 relative); bf16 with bf16
    # accumulation rounds each micro-batch's and each rank's sum (reference.TOLERANCES).
    tol = TOLERANCES[mode].grad
    scale = max(float(g.abs().max()) for g in ref.grads[0].values())
    for rank, out in enumerate(per_rank):
        assert out["exposed_again"]
        for name, grad in out["grad"].items():
            assert grad is not None, (rank, name)
            expected = ref.grads[0][name]
            assert grad.shape == expected.shape, (rank, name)
            torch.testing.assert_close(grad.float(), expected, rtol=0, atol=tol * scale, msg=f"rank {rank} {name}")
            torch.testing.assert_close(grad.float(), out["full"][name], rtol=0, atol=0, msg=name)
        assert out["shares_buffer"] and all(out["shares_buffer"])
        assert out["unchanged_by_zeroed_step"] is True
        # The exact global norm: every rank holds the whole gradient, each element counts once.
        assert abs(out["norm"] / ref.grad_norms[0] - 1) <= TOLERANCES[mode].first_norm, (rank, out["norm"])
    # Every rank holds the same reduced gradient, bitwise.
    for name in per_rank[0]["grad"]:
        assert torch.equal(per_rank[0]["grad"][name], per_rank[1]["grad"][name]), name
