"""The reduced gradient released after every step (zeroshard/grads/buffers.py, [Note: released
between steps on an accelerator]: on a GPU it is freed, 4 bytes per parameter off the peak;
here forced on the CPU) trains exactly as the single-process reference says, with the
conformance matrix's tolerances (tests/dist/reference.py), at every stage, with gradient
accumulation, in fp32 and bf16: a freed buffer that came back holding stale values, or one
freed before the step read it, would move the parameters by whole gradients."""

from __future__ import annotations

import pytest

from tests.dist.reference import check_against_reference, reference_for, run_all, world_losses
from tests.dist.scenarios.common import Case

WORLD = 2
CASES = [Case(stage=stage, mode=mode, ga=2) for stage in (0, 1, 2, 3) for mode in ("fp32", "bf16")]


@pytest.fixture(scope="module")
def per_rank(dist_pool):
    return dist_pool(WORLD).run("tests.dist.scenarios.grad_release:train_released", CASES, timeout=300)


def test_released_buffers_train_as_the_reference(per_rank) -> None:
    def check(index: int, case: Case):
        def run() -> None:
            result = per_rank[0][index]
            check_against_reference(
                result, reference_for(case, WORLD), case.mode, case.settings, world_losses(per_rank, index), case.label
            )

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(CASES))


def test_nothing_reduced_is_held_between_steps(per_rank) -> None:
    for rank in per_rank:
        for case, result in zip(CASES, rank, strict=True):
            assert result["held_after_step"] == [False] * case.steps, case.label
