"""Every way of calling backward gives the reference's update (docs/design.md section 4).

Styles (tests/dist/scenarios/backward_styles.py): engine.backward(loss); plain
loss.backward(); a non-scalar logits.backward(grad); reentrant and non-reentrant activation
checkpointing of the blocks; a loss tiled by an autograd call inside forward; a loss built
from engine.module(...) outputs; k backward calls with set_gradient_accumulation_boundary;
no_sync() for all but the last micro-step; two backward calls before one step with k = 1.
Stages 0-3, fp32, bf16 and fp16, 2 ranks, 2 optimizer steps each. The model's `unused`
Linear is never called, so every run also covers unused parameters.

Each style is checked against the one-process reference (tolerances: reference.TOLERANCES)
and, where the arithmetic is the same, bitwise against the engine.backward run.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import check_against_reference, flat_cat, reference_for, run_all, world_losses
from tests.dist.scenarios.backward_styles import STYLE_BACKWARD_CALLS, run_style_cases
from tests.dist.scenarios.common import Case

STAGES = (0, 1, 2, 3)
MODES = ("fp32", "bf16", "fp16")
STEPS = 2
TIMEOUT_S = 600
# (style, gradient_accumulation_steps). The "engine" runs are the baselines.
STYLE_GA = [
    ("engine", 2),
    ("plain", 2),
    ("nonscalar", 2),
    ("module_loss", 2),
    ("ckpt_reentrant", 2),
    ("ckpt_nonreentrant", 2),
    ("tiled_loss", 2),
    ("engine", 4),
    ("boundary_flag", 4),
    ("no_sync", 4),
    ("two_backward", 1),
]


def bitwise_with_baseline(style: str, mode: str, stage: int) -> bool:
    """Whether a style does exactly the arithmetic of the engine.backward loop.

    Not: the tiled loss (sums chunk losses), two backward calls (no baseline), no_sync at
    stages 2-3 (one reduction of the local sum instead of one per micro-step), and the
    non-scalar backward in fp16 (the gradient enters the fp16 model unscaled and is scaled
    there, where the in-graph loss scales it in fp32 first: small values round differently
    near fp16's subnormal range).
    """
    if style in ("tiled_loss", "two_backward", "engine"):
        return False
    if style == "no_sync":
        return stage in (0, 1)
    if style == "nonscalar":
        return mode != "fp16"
    return True


def style_cases() -> list[Case]:
    cases = []
    for mode in MODES:
        for stage in STAGES:
            for style, ga in STYLE_GA:
                cases.append(Case(stage=stage, mode=mode, ga=ga, steps=STEPS, style=style, keep=("master", "grad0")))
    return cases


@pytest.fixture(scope="module")
def style_results(dist_pool):
    cases = style_cases()
    return cases, dist_pool(2).run(run_style_cases, cases, timeout=TIMEOUT_S)


def test_each_style_matches_the_reference(style_results) -> None:
    cases, per_rank = style_results

    def check(index: int, case: Case):
        def run() -> None:
            ref = reference_for(case, 2, loss_terms=STYLE_BACKWARD_CALLS.get(case.style, 1))
            check_against_reference(
                per_rank[0][index], ref, case.mode, case.settings, world_losses(per_rank, index), case.label
            )

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


def test_styles_match_engine_backward_bitwise(style_results) -> None:
    """Where a style does the same arithmetic as the engine.backward loop, the parameters,
    gradients, norms and losses are bitwise those of that loop."""
    cases, per_rank = style_results
    baseline = {(c.mode, c.stage, c.ga): i for i, c in enumerate(cases) if c.style == "engine"}

    def check(index: int, case: Case):
        def run() -> None:
            base = per_rank[0][baseline[(case.mode, case.stage, case.ga)]]
            result = per_rank[0][index]
            assert result["losses"] == base["losses"], "losses differ"
            assert result["grad_norms"] == base["grad_norms"], "grad norms differ"
            assert result["loss_scales"] == base["loss_scales"], "loss scales differ"
            assert torch.equal(flat_cat(result["grad0"]), flat_cat(base["grad0"])), "first-step gradients differ"
            for step in range(STEPS):
                assert torch.equal(flat_cat(result["master"][step]), flat_cat(base["master"][step])), (
                    f"parameters differ after step {step + 1}"
                )

        return run

    checks = [
        (case.label, check(i, case))
        for i, case in enumerate(cases)
        if bitwise_with_baseline(case.style, case.mode, case.stage)
    ]
    run_all(checks)


def test_fp16_every_style_is_loss_scaled(style_results) -> None:
    """In fp16 every style, plain loss.backward() included, runs with the engine's loss scale
    (2**8 here). An unscaled backward would still be divided by the scale at the step, so its
    gradient would be 256x too small: the reference check above would fail on the norm."""
    cases, per_rank = style_results
    for index, case in enumerate(cases):
        if case.mode == "fp16":
            assert per_rank[0][index]["loss_scales"] == [2.0**8] * STEPS, case.label


def test_unused_parameters_get_zero_gradients_and_a_step(style_results) -> None:
    """The `unused` Linear takes no part in any backward: its gradient is exactly zero, its
    unit still completes, and the step is still taken (AdamW's decoupled weight decay
    shrinks it by exactly (1 - lr * wd), its moments stay zero)."""
    cases, per_rank = style_results
    for index, case in enumerate(cases):
        result = per_rank[0][index]
        lr, wd = case.settings.lr, case.settings.weight_decay
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(result["grad0"][name], torch.zeros_like(result["grad0"][name])), (case.label, name)
            start, after = result["initial_master"][name], result["master"][0][name]
            assert torch.equal(after, start * (1 - lr * wd)), (case.label, name)
