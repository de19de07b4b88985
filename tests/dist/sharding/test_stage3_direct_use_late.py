"""A direct use that first appears at a later step is gathered where it is used, and the
parameter classes of the direct-use watch (zeroshard/sharding/direct_use.py, issue 23 item 8).

The watch is armed for every root forward, whatever earlier forwards did: nothing is learnt
from the first steps, so a use that appears on step 3 (a branch taken late) is seen like one
on step 1. LateUseModel (tests/dist/scenarios/direct_use_late.py) adds
`0.1 * h @ blocks[2].fc.weight.T` in the root from its third training forward on; stage 3's
losses and reduced gradients of every step must be stage 0's.

Tolerance: 1e-6 absolute on the gradients and losses (reference.TOLERANCES["fp32"]): stage 3
reduces each unit by reduce-scatter, stage 0 by all-reduce, so the two ranks' shares may be
summed in another order; a use that read a freed (empty) or stale weight would fail the shape
check or be off by far more (the late term is 10% of the hidden state).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.direct_use_late import late_direct_use

STEPS = 4
LATE_FROM = 3
ATOL = 1e-6


@pytest.fixture(scope="module")
def runs(dist_pool):
    pool = dist_pool(2)
    return {stage: pool.run(late_direct_use, stage, STEPS, LATE_FROM, timeout=300) for stage in (0, 3)}


def test_a_use_first_made_on_a_later_step_gives_stage0_gradients(runs) -> None:
    for rank in range(2):
        s0, s3 = runs[0][rank], runs[3][rank]
        torch.testing.assert_close(torch.tensor(s3["losses"]), torch.tensor(s0["losses"]), atol=ATOL, rtol=0)
        for step in range(STEPS):
            assert set(s3["grads"][step]) == set(s0["grads"][step])
            for name, grad in s0["grads"][step].items():
                label = f"rank {rank} step {step} {name}"
                torch.testing.assert_close(s3["grads"][step][name], grad, atol=ATOL, rtol=0,
                                           msg=lambda m, s=label: f"{s}: {m}")


def test_the_late_use_changes_the_gradient(runs) -> None:
    """The use counts: block 2's weight gradient jumps when it starts (else the test above
    could pass with a use that contributes nothing)."""
    grads = [g["blocks.2.fc.weight"] for g in runs[0][0]["grads"]]
    before, after = grads[LATE_FROM - 2].norm(), grads[LATE_FROM - 1].norm()
    assert abs(after - before) > 0.05 * before, (before, after)


def test_watched_only_outside_their_unit_and_only_during_the_forward(runs) -> None:
    for rank in range(2):
        s3, s0 = runs[3][rank], runs[0][rank]
        assert s3["seen"] == {
            "blocks.1's, in the root": "WatchedParameter",  # its unit is not running
            "own, in its forward": "Parameter",  # the unit's own code dispatches as ever
            "peer's, in its forward": "WatchedParameter",  # another unit's, from inside a unit
        }, s3["seen"]
        assert s3["plain_after"] and s3["classes_after"] == {"Parameter"}, s3["classes_after"]
        assert set(s0["seen"].values()) == {"Parameter"} and s0["plain_after"], s0["seen"]
