"""Overflow handling and gradient clipping across ranks (docs/design.md section 5).

Overflow: an inf in one rank's gradient must skip the step on every rank in every precision
mode (fp32 and torch_autocast too), lower the fp16 loss scale as the hysteresis says, leave
parameters and optimizer state untouched, count the skipped step, log the rank it came from,
and the next clean step must go on as if the bad steps never happened.
`zeroshard.skip_nonfinite_steps: false` restores DeepSpeed's fp32 behaviour (the step runs).

Clipping: `get_global_grad_norm()` is the pre-clip norm of the full reduced gradient (the
gradient of the mean loss over the global batch), on every stage (never None, which it was
at stage 0 in DeepSpeed 0.19), and the update is the reference's clipped update.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.dist.reference import (
    TOLERANCES,
    TrainSettings,
    check_against_reference,
    global_batches,
    reference_for,
    reference_train,
    run_all,
    world_losses,
)
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.conformance import run_cases
from tests.dist.scenarios.overflow import ADAMW_STATE_KEYS, overflow_run

STAGES = (0, 1, 2, 3)
TIMEOUT_S = 600
BAD_STEPS = (1, 2)  # 0-based: steps 2 and 3 overflow on rank 1; steps 1 and 4 are clean
BAD_RANK = 1
STEPS = 4


def _equal_named(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


@pytest.fixture(scope="module")
def overflow_results(dist_pool):
    cases = [
        Case(stage=stage, mode=mode, steps=STEPS, keep=()) for mode in ("fp16", "bf16", "fp32") for stage in STAGES
    ]
    cases += [Case(stage=stage, mode="autocast_bf16", steps=STEPS, keep=()) for stage in (0, 3)]
    return cases, dist_pool(2).run(overflow_run, cases, BAD_STEPS, BAD_RANK, timeout=TIMEOUT_S)


def test_overflow_on_one_rank_skips_the_step_everywhere(overflow_results) -> None:
    """Steps 2 and 3 overflow on rank 1 only. On both ranks: skipped_steps counts 0, 1, 2, 2;
    global_steps still advances (DeepSpeed counts skipped steps as steps); masters and AdamW
    state (exp_avg, exp_avg_sq, step) after a skipped step are bitwise those before it; the
    fp16 scale follows DeepSpeed's hysteresis 2 (the first overflow uses up the hysteresis and
    keeps 2**8, the second halves it to 2**7); bf16 (check_grad_overflow true by default)
    skips the same steps with no scale."""
    cases, per_rank = overflow_results

    def check(index: int, case: Case):
        def run() -> None:
            for rank, results in enumerate(per_rank):
                result = results[index]
                assert result["skipped"] == [0, 1, 2, 2], f"rank {rank}: skipped_steps {result['skipped']}"
                assert result["global_steps"] == [1, 2, 3, 4], f"rank {rank}: global_steps {result['global_steps']}"
                expected_scales = [256.0, 256.0, 128.0, 128.0] if case.mode == "fp16" else [1.0] * STEPS
                assert result["scale_after"] == expected_scales, f"rank {rank}: scales {result['scale_after']}"
                for step in BAD_STEPS:
                    assert _equal_named(result["master"][step], result["master"][step - 1]), (
                        f"rank {rank}: parameters changed by skipped step {step + 1}"
                    )
                    for key in ADAMW_STATE_KEYS:
                        assert _equal_named(result["state"][step][key], result["state"][step - 1][key]), (
                            f"rank {rank}: optimizer state {key} changed by skipped step {step + 1}"
                        )
                for step in range(STEPS):
                    nonfinite = [text for _, text in result["log"][step] if "non-finite" in text]
                    if step in BAD_STEPS:
                        assert len(nonfinite) == 1 and f"from rank(s) {BAD_RANK};" in nonfinite[0], (
                            f"rank {rank}: step {step + 1} logged {result['log'][step]}"
                        )
                        assert "step skipped" in nonfinite[0], nonfinite[0]
                    else:
                        assert not nonfinite, f"rank {rank}: clean step {step + 1} logged {nonfinite}"
                # The clean steps do move the parameters.
                assert not _equal_named(result["master"][0], result["initial_master"])
                assert not _equal_named(result["master"][3], result["master"][2])
            for step in range(STEPS):
                assert _equal_named(per_rank[0][index]["master"][step], per_rank[1][index]["master"][step]), (
                    f"ranks disagree on the parameters after step {step + 1}"
                )

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


def test_training_after_skipped_steps_matches_the_reference(overflow_results) -> None:
    """Skipped steps change nothing, so the run equals the reference trained on the clean
    steps' batches only (steps 1 and 4), within the mode's tolerance; the optimizer's step
    count is 2 at the end."""
    cases, per_rank = overflow_results
    for index, case in enumerate(cases):
        result = per_rank[0][index]
        batches = global_batches(case.seed, STEPS, 2 * case.micro * case.ga)
        clean = [b for i, b in enumerate(batches) if i not in BAD_STEPS]
        ref = reference_train(clean, case.mode, case.settings, case.seed)
        engine_view = {
            "initial_master": result["initial_master"],
            "master": [result["master"][0], result["master"][3]],  # after the clean steps
            "grad_norms": [result["grad_norms"][0], result["grad_norms"][3]],
        }
        clean_steps = [i for i in range(STEPS) if i not in BAD_STEPS]
        losses = [
            sum(loss for results in per_rank for loss in results[index]["losses"][i]) / (2 * case.ga)
            for i in clean_steps
        ]
        check_against_reference(engine_view, ref, case.mode, case.settings, losses, case.label)
        steps = result["state"][3]["step"]
        assert all(float(v) == 2.0 for v in steps.values()), f"{case.label}: optimizer step counts {steps}"


def test_skip_nonfinite_steps_false_keeps_deepspeeds_behaviour(dist_pool) -> None:
    """fp32 with zeroshard.skip_nonfinite_steps false: the poisoned step is taken (no skipped
    step counted), so the masters become non-finite on every rank, as DeepSpeed's do; the log
    still names the rank and says the check is off."""
    cases = [
        Case(stage=stage, steps=2, keep=(), extra={"zeroshard": {"skip_nonfinite_steps": False}}, variant="noskip")
        for stage in (0, 3)
    ]
    per_rank = dist_pool(2).run(overflow_run, cases, (1,), BAD_RANK, timeout=TIMEOUT_S)
    for rank, results in enumerate(per_rank):
        for case, result in zip(cases, results, strict=True):
            assert result["skipped"] == [0, 0], (case.label, rank, result["skipped"])
            after = result["master"][1]
            assert not all(torch.isfinite(t).all() for t in after.values()), f"{case.label}: step was skipped"
            said = [text for _, text in result["log"][1] if "non-finite" in text]
            assert len(said) == 1 and "zeroshard.skip_nonfinite_steps is false" in said[0], (case.label, said)


def test_overflow_steps_report_a_nonfinite_norm(overflow_results) -> None:
    """The skipped steps' global norm is not finite on every rank (the overflow was agreed on
    through the norm), the clean steps' norms are finite."""
    cases, per_rank = overflow_results
    for index, case in enumerate(cases):
        for results in per_rank:
            norms = results[index]["grad_norms"]
            finite = [norm is not None and torch.isfinite(torch.tensor(norm)).item() for norm in norms]
            assert finite == [True, False, False, True], (case.label, norms)


# ------------------------------------------------------------------------------------ clipping

CLIP = 0.05  # far below this model's gradient norms (1.3 to 4.3): every step is clipped


def clipping_cases() -> list[Case]:
    cases = []
    for stage in STAGES:
        for optimizer in ("SGD", "AdamW"):
            cases.append(Case(stage=stage, settings=TrainSettings(optimizer=optimizer, clip=CLIP)))
        cases.append(Case(stage=stage, mode="bf16", settings=TrainSettings(clip=CLIP)))
    return cases


@pytest.mark.parametrize("world_size", [2, 3])
def test_clipping_uses_the_global_norm(dist_pool, world_size: int) -> None:
    """gradient_clipping 0.05: the reported pre-clip norm equals the reference's full-gradient
    norm (fp32: 2e-6 relative; bf16: see reference.TOLERANCES), the post-clip norm is the clip,
    and the parameters follow the reference's clipped updates (SGD makes the clip coefficient
    show in the update directly; AdamW through its moments), on every stage."""
    cases = clipping_cases()
    per_rank = dist_pool(world_size).run(run_cases, cases, timeout=TIMEOUT_S)

    def check(index: int, case: Case):
        def run() -> None:
            ref = reference_for(case, world_size)
            for results in per_rank:
                result = results[index]
                check_against_reference(
                    result, ref, case.mode, case.settings, world_losses(per_rank, index), case.label
                )
                tol = TOLERANCES[case.mode]
                for norm, post in zip(result["grad_norms"], result["post_clip_norms"], strict=True):
                    assert norm > CLIP
                    assert abs(post - CLIP) <= tol.first_norm * CLIP + 1e-6, f"post-clip norm {post}"

        return run

    run_all((f"{case.label}-{case.settings.optimizer}", check(i, case)) for i, case in enumerate(cases))


def test_clipping_changes_the_update() -> None:
    """The clipping test is not vacuous: without clipping the reference ends elsewhere."""
    settings = TrainSettings(optimizer="SGD", clip=CLIP)
    batches = global_batches(0, 3, 4)
    clipped = reference_train(batches, "fp32", settings)
    free = reference_train(batches, "fp32", replace(settings, clip=0.0))
    diff = max(float((clipped.params[-1][n] - free.params[-1][n]).abs().max()) for n in free.params[-1])
    assert diff > 1e-3
