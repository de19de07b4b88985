"""`param.grad` after the boundary backward (DeepSpeed users log and inspect it), 2 ranks.

Stage 0 (fp32, and bf16 with bf16 accumulation): every trainable parameter's `.grad` is the
reduced, averaged gradient, equal to `safe_get_full_grad`, and a view of the flat's reduced
buffer (no second copy); zeroing it in place makes the step a no-op for SGD without weight
decay; it is None before the boundary and after the step. Stages 1-3, and bf16 with fp32
accumulation: `.grad` stays None (no whole reduced gradient of the parameter's dtype exists
on the rank; see zeroshard/grad_views.py)."""

from __future__ import annotations

import pytest
import torch

CASES = [(0, "fp32"), (0, "bf16_accum_bf16"), (0, "bf16"), (1, "fp32"), (2, "fp32"), (3, "fp32")]


@pytest.fixture(scope="module")
def results(dist_pool):
    pool = dist_pool(2)
    return {case: pool.run("tests.dist.scenarios.grad_views:grad_views", *case, timeout=300)[0] for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{m}" for s, m in CASES])
def test_param_grad_after_the_boundary_backward(results, case) -> None:
    out = results[case]
    assert all(out["after_first"]), "no .grad before the boundary backward"
    assert all(out["after_step"]), "no .grad after the step"
    exposed = case in ((0, "fp32"), (0, "bf16_accum_bf16"))
    if not exposed:
        assert all(g is None for g in out["grad"].values()), case
        return
    for name, grad in out["grad"].items():
        assert grad is not None, name
        torch.testing.assert_close(grad.float(), out["full"][name], rtol=0, atol=0, msg=name)
    assert out["shares_buffer"] and all(out["shares_buffer"])
    assert out["unchanged_by_zeroed_step"] is True
