"""The engine against a single-process reference, across stages, precisions and world sizes.

docs/design.md section 5: reference equivalence, stage equivalence, replica consistency,
accumulation-split invariance, the accumulation dtype, and the DeepSpeed regressions.

The matrix (stages 0-3 x twelve precision modes x gradient_accumulation_steps 1 and 4) runs
once per world size, in one task on a pooled process group, and several tests read it.
World size 3 pads every flat buffer (the units have 332 and 304 elements).
Tolerances, and why they are what they are: tests/dist/reference.py, `TOLERANCES`.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import (
    MODES,
    TOLERANCES,
    ReferenceResult,
    TrainSettings,
    check_against_reference,
    flat_cat,
    global_batches,
    reference_for,
    reference_train,
    run_all,
    world_losses,
)
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.conformance import (
    PROBE_LARGE,
    PROBE_SMALL,
    accumulation_probe,
    gathered_parameters_round_trip,
    run_cases,
)

STAGES = (0, 1, 2, 3)
GRAD_ACCUM = (1, 4)
WORLD_SIZES = (1, 2, 3)  # 1: the single-process path (no process group collectives)
MATRIX_TIMEOUT_S = 600
PARAM_DTYPE = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "bf16_accum_bf16": torch.bfloat16,
    "fp16": torch.float16,
    "autocast_bf16": torch.float32,
    "bf16_autocast": torch.bfloat16,
    "fp32_accum_bf16": torch.float32,
    "fp32_comm_bf16": torch.float32,
    "fp32_comm_fp16": torch.float32,
    "bf16_accum_fp16": torch.bfloat16,
    "fp16_accum_bf16": torch.float16,
    "autocast_comm_bf16": torch.float32,
}


# Stage 3 with the root unit (332 elements) sharded and the blocks (304) resident
# (stage3_param_persistence_threshold): both kinds of unit in one model.
RESIDENT_BLOCKS = {"zero_optimization": {"stage3_param_persistence_threshold": 320}}


# Reduce and all-gather buckets far smaller than the model (1244 elements): every backward
# issues several buckets, completes older ones while the next fills (grad_reduce.py's double
# buffering) and cuts flats across buckets; autocast has two wire dtypes, i.e. two open buckets.
SMALL_BUCKETS = {"zero_optimization": {"reduce_bucket_size": 300, "allgather_bucket_size": 300}}


def matrix_cases() -> list[Case]:
    cases = [Case(stage=stage, mode=mode, ga=ga) for mode in MODES for ga in GRAD_ACCUM for stage in STAGES]
    cases += [
        Case(stage=3, mode=mode, ga=ga, extra=RESIDENT_BLOCKS, variant="resident-blocks")
        for mode in ("fp32", "bf16")
        for ga in GRAD_ACCUM
    ]
    cases += [
        Case(stage=stage, mode=mode, ga=ga, extra=SMALL_BUCKETS, variant="small-buckets")
        for mode in ("fp32", "autocast_bf16")
        for ga in GRAD_ACCUM
        for stage in STAGES
    ]
    return cases


@pytest.fixture(scope="module")
def matrix(dist_pool):
    """`matrix(world_size)` -> (cases, results[rank][case]); each world size runs once."""
    cache: dict[int, tuple[list[Case], list[list[dict]]]] = {}

    def get(world_size: int):
        if world_size not in cache:
            cases = matrix_cases()
            cache[world_size] = cases, dist_pool(world_size).run(run_cases, cases, timeout=MATRIX_TIMEOUT_S)
        return cache[world_size]

    return get


def as_reference(result: dict, per_rank: list[list[dict]], index: int) -> ReferenceResult:
    """An engine run in the reference's form, to compare two engine runs with the same checks."""
    return ReferenceResult(
        initial=result["initial_master"],
        params=result["master"],
        losses=world_losses(per_rank, index),
        grad_norms=result["grad_norms"],
        grads=[result["grad0"]],
    )


# --------------------------------------------------------------------- reference equivalence


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reference_equivalence(matrix, world_size: int) -> None:
    """W ranks x micro-batch 2 x k micro-steps == one process on the W*2*k global batch, for
    every stage and precision mode: losses, grad norms and parameters of 3 AdamW steps with
    clipping active (norms 1.3-4.3 against a clip of 1.0), the first step tightly."""
    cases, per_rank = matrix(world_size)

    def check(index: int, case: Case):
        def run() -> None:
            ref = reference_for(case, world_size)
            result = per_rank[0][index]
            check_against_reference(result, ref, case.mode, case.settings, world_losses(per_rank, index), case.label)

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


# ------------------------------------------------------------------------ replica consistency


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_replica_consistency(matrix, world_size: int) -> None:
    """After every step, every rank holds bitwise the same full parameters (as the module
    sees them, gathered at stage 3) and the same fp32 masters, and the module's parameters
    are the masters cast to the parameter dtype."""
    cases, per_rank = matrix(world_size)

    def check(index: int, case: Case):
        def run() -> None:
            results = [rank[index] for rank in per_rank]
            for step in range(case.steps):
                ref_module = results[0]["module"][step]
                ref_master = results[0]["master"][step]
                for rank, result in enumerate(results):
                    for name, value in result["module"][step].items():
                        assert value.dtype == PARAM_DTYPE[case.mode], f"{name} is {value.dtype}"
                        assert torch.equal(value, ref_module[name]), (
                            f"step {step + 1}: rank {rank}'s {name} differs from rank 0's"
                        )
                        assert torch.equal(value, result["master"][step][name].to(value.dtype)), (
                            f"step {step + 1}: rank {rank}'s module {name} is not its master cast to {value.dtype}"
                        )
                    for name, value in result["master"][step].items():
                        assert torch.equal(value, ref_master[name]), (
                            f"step {step + 1}: rank {rank}'s master {name} differs from rank 0's"
                        )

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


# ------------------------------------------------------------------------- stage equivalence


def test_stages_are_bitwise_identical_without_accumulation(matrix) -> None:
    """World size 2, one micro-step per step: stages 0-3 give bitwise-identical parameters,
    losses and norms after every step (the cross-rank sum a + b is commutative, so an
    all-reduce and a reduce-scatter give the same bits), in every precision mode."""
    cases, per_rank = matrix(2)
    base_index = {c.mode: i for i, c in enumerate(cases) if (c.ga, c.stage, c.variant) == (1, 0, "")}

    def check(index: int, case: Case):
        def run() -> None:
            base = per_rank[0][base_index[case.mode]]
            other = per_rank[0][index]
            assert other["losses"] == base["losses"], "losses differ"
            assert other["grad_norms"] == base["grad_norms"], "grad norms differ"
            for step in range(len(base["master"])):
                for name in base["master"][step]:
                    assert torch.equal(other["master"][step][name], base["master"][step][name]), (
                        f"step {step + 1}: {name} differs from stage 0"
                    )
                    assert torch.equal(other["module"][step][name], base["module"][step][name])

        return run

    run_all(
        (f"{case.label} vs stage 0", check(i, case))
        for i, case in enumerate(cases)
        if case.ga == 1 and (case.stage, case.variant) != (0, "")
    )


def test_stages_agree_with_accumulation(matrix) -> None:
    """World size 2, k = 4: stages 0 and 1 both sum the micro-steps locally and reduce once,
    so they agree bitwise; stages 2 and 3 both reduce every micro-step, so they agree
    bitwise; across the two pairs the sums run in another order: fp32 tolerance
    (1e-6 absolute, see reference.TOLERANCES)."""
    cases, per_rank = matrix(2)
    by_key = {(c.mode, c.ga, c.stage): i for i, c in enumerate(cases) if not c.variant}
    results = {stage: per_rank[0][by_key[("fp32", 4, stage)]] for stage in STAGES}
    for a, b in ((0, 1), (2, 3)):
        for step in range(3):
            for name, value in results[a]["master"][step].items():
                assert torch.equal(results[b]["master"][step][name], value), (
                    f"stage {b} vs {a}, step {step + 1}: {name}"
                )
    tol = TOLERANCES["fp32"]
    for step in range(3):
        torch.testing.assert_close(
            flat_cat(results[2]["master"][step]),
            flat_cat(results[0]["master"][step]),
            atol=tol.param_atol,
            rtol=tol.param_rtol,
        )


# --------------------------------------------------------------- accumulation-split invariance


def test_accumulation_split_invariance(dist_pool) -> None:
    """(micro 8, k 1) and (micro 2, k 4) see the same 16 rows per step on 2 ranks and must give
    the same updates: in bf16 with fp32 accumulation within the bf16 tolerance (the two
    micro-batch sizes round bf16 compute differently, as the reference's one big batch does;
    see reference.TOLERANCES), in fp32 within the fp32 tolerance; stages 0-3."""
    pairs = [
        (Case(stage=stage, mode=mode, micro=8, ga=1), Case(stage=stage, mode=mode, micro=2, ga=4))
        for mode in ("bf16", "fp32")
        for stage in STAGES
    ]
    cases = [c for pair in pairs for c in pair]
    per_rank = dist_pool(2).run(run_cases, cases, timeout=MATRIX_TIMEOUT_S)

    def check(index: int):
        def run() -> None:
            whole, split = cases[2 * index], cases[2 * index + 1]
            baseline = as_reference(per_rank[0][2 * index], per_rank, 2 * index)
            check_against_reference(
                per_rank[0][2 * index + 1],
                baseline,
                split.mode,
                split.settings,
                world_losses(per_rank, 2 * index + 1),
                f"{split.label} vs {whole.label}",
            )
            # Both must also follow the one-process reference on the same rows.
            ref = reference_for(whole, 2)
            check_against_reference(
                per_rank[0][2 * index], ref, whole.mode, whole.settings, world_losses(per_rank, 2 * index), whole.label
            )

        return run

    run_all((f"pair {i}", check(i)) for i in range(len(pairs)))


# ------------------------------------------------------------------ accumulation dtype is real


def _probe_expected(world_size: int, ga: int) -> float:
    """The exact mean gradient of the probe (every element): (W * (1 + (k-1) * 2**-9)) / (W*k)."""
    total = world_size * (PROBE_LARGE + (ga - 1) * PROBE_SMALL)
    return total / (world_size * ga)


@pytest.mark.parametrize("use_no_sync", [False, True], ids=["synced", "no_sync"])
def test_accumulation_dtype_is_real(dist_pool, use_no_sync: bool) -> None:
    """3 ranks, k = 4, bf16: micro-step 0 gives a gradient of 1, micro-steps 1-3 give 2**-9
    each. Summed in fp32 the small ones survive (1 + 3 * 2**-9 is exact); summed in bf16 each
    rounds away (bf16's ulp at 1 is 2**-7). So bf16 with fp32 accumulation must be exact to
    fp32 rounding (1e-6 relative), and bf16 accumulation measurably worse (>= 5e-4 relative;
    the expected loss is 0.75 * 2**-9 / 0.2515 = 5.8e-3). The collective recorder must show
    the reduce in fp32 and bf16 respectively. With 2 ranks a bf16 sum of two values equals
    the rounded fp32 sum, which is why this needs 3.

    The no_sync variant keeps micro-steps 0-2 local (docs/design.md section 4): the local sum must
    still be kept in the accumulation dtype, at every stage.
    """
    world_size, ga = 3, 4
    expected = _probe_expected(world_size, ga)
    cases = [Case(stage=stage, mode=mode, ga=ga) for mode in ("bf16", "bf16_accum_bf16") for stage in STAGES]
    per_rank = dist_pool(world_size).run(accumulation_probe, cases, use_no_sync, timeout=MATRIX_TIMEOUT_S)

    def check(index: int, case: Case):
        def run() -> None:
            result = per_rank[0][index]
            grad = result["grad"]
            assert grad is not None, "safe_get_full_grad returned None after the boundary backward"
            err = float((grad - expected).abs().max()) / expected
            if case.mode == "bf16":
                assert result["grad_dtypes"] == ["torch.float32"], result["grad_dtypes"]
                assert err <= 1e-6, f"fp32 accumulation: gradient {grad.tolist()} vs exact {expected} (rel {err:.2e})"
            else:
                assert result["grad_dtypes"] == ["torch.bfloat16"], result["grad_dtypes"]
                assert err >= 5e-4, f"bf16 accumulation unexpectedly exact: {grad.tolist()} (rel {err:.2e})"
            for rank in per_rank:
                assert torch.equal(rank[index]["grad"], grad), "ranks disagree on the full gradient"

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


# ------------------------------------------------------------------------ DeepSpeed regressions
#
# docs/design.md section 5's list of what DeepSpeed 0.19.8 got wrong here. Two of them live elsewhere:
# get_global_grad_norm() is checked to be a number on every stage by every reference
# comparison (reference.check_against_reference) and by test_overflow_clipping.py; an
# autograd call inside forward is the "tiled_loss" style of test_backward_styles.py, run on
# stages 0-3.


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_first_adamw_update_is_lr_sized(matrix, mode: str) -> None:
    """DeepSpeed 0.19 at stage 0 in bf16/fp16 ran one optimizer step on zero gradients at
    start-up, so AdamW's bias correction was a step off and the first update was 0.735 x lr.
    AdamW's first update is exactly lr * g / (|g| + eps) plus weight decay: for every element
    with a clear gradient, |p1 - p0 * (1 - lr * wd)| must be lr to within eps / |g| (and fp32
    rounding), on every stage."""
    cases, per_rank = matrix(2)
    for index, case in enumerate(cases):
        if case.mode != mode or case.ga != 1:
            continue
        result = per_rank[0][index]
        lr, wd = case.settings.lr, case.settings.weight_decay
        p0, p1 = flat_cat(result["initial_master"]), flat_cat(result["master"][0])
        grad = flat_cat(result["grad0"])
        clear = grad.abs() > 1e-3  # eps / |g| <= 1e-5
        step = (p1 - p0 * (1 - lr * wd)).abs()[clear] / lr
        assert clear.sum() > 1000, "too few elements to judge"
        assert float((step - 1).abs().max()) <= 1e-4, f"{case.label}: first update / lr in [{step.min()}, {step.max()}]"


def test_fp16_stage0_update_is_not_shrunk_by_the_loss_scale(matrix) -> None:
    """DeepSpeed 0.19 at stage 0 in fp16 never multiplied the loss by the scale but divided the
    gradients by it (updates 65536x too small). Here: the loss is scaled (engine.loss_scale is
    2**8 during the step), and the gradient and its norm, unscaled, equal the reference's
    within the fp16 tolerance: a missing or doubled scale would be off by 256x."""
    cases, per_rank = matrix(2)
    for stage in STAGES:
        index = next(i for i, c in enumerate(cases) if (c.mode, c.ga, c.stage, c.variant) == ("fp16", 1, stage, ""))
        case, result = cases[index], per_rank[0][index]
        assert result["loss_scales"] == [2.0**8] * case.steps
        ref = reference_for(case, 2)
        ratio = result["grad_norms"][0] / ref.grad_norms[0]
        assert abs(ratio - 1) <= TOLERANCES["fp16"].first_norm, f"stage {stage}: norm ratio {ratio}"


def test_bf16_with_fp32_accumulation_works_at_stage0(matrix) -> None:
    """DeepSpeed 0.19 refused bf16 with fp32 gradient accumulation at stage 0. Here it is the
    default: the stage-0 bf16 runs exist and follow the reference (3 ranks, so a bf16
    reduction would show), and their gradients were reduced in fp32 (test_comm_dtypes)."""
    cases, per_rank = matrix(3)
    for index, case in enumerate(cases):
        if case.mode == "bf16" and case.stage == 0:
            ref = reference_for(case, 3)
            check_against_reference(
                per_rank[0][index], ref, "bf16", case.settings, world_losses(per_rank, index), case.label
            )


def test_zero_dim_parameter(matrix) -> None:
    """DeepSpeed 0.19 crashed at start-up on a 0-d parameter. The model's `gain` is one: on
    every stage and world size it keeps its shape, gets its gradient and follows the
    reference (fp32 runs: to 1e-6)."""
    for world_size in WORLD_SIZES:
        cases, per_rank = matrix(world_size)
        for index, case in enumerate(cases):
            if case.mode != "fp32":
                continue
            result = per_rank[0][index]
            ref = reference_for(case, world_size)
            assert result["grad0"]["gain"].shape == torch.Size([])
            torch.testing.assert_close(result["grad0"]["gain"], ref.grads[0]["gain"], atol=1e-6, rtol=1e-5)
            for step in range(case.steps):
                gain = result["master"][step]["gain"]
                assert gain.shape == torch.Size([]) and result["module"][step]["gain"].shape == torch.Size([])
                torch.testing.assert_close(gain, ref.params[step]["gain"], atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------ GatheredParameters


@pytest.mark.parametrize("mode", ["fp32", "bf16", "autocast_bf16"])
def test_gathered_parameters_are_the_full_parameters(dist_pool, mode: str) -> None:
    """`GatheredParameters` shows the module's full parameters at every stage (the masters
    cast to the parameter dtype), and a `modifier_rank` block that changes nothing leaves
    the masters bitwise unchanged."""
    cases = [Case(stage=stage, mode=mode, steps=1, keep=()) for stage in STAGES]
    per_rank = dist_pool(2).run(gathered_parameters_round_trip, cases, timeout=MATRIX_TIMEOUT_S)

    def check(index: int, case: Case):
        def run() -> None:
            result = per_rank[0][index]
            for name, master in result["before"].items():
                seen = result["seen"][name]
                assert torch.equal(seen, master.to(seen.dtype)), f"{name}: gathered value is not the parameter"
                assert torch.equal(result["after"][name], master), f"{name}: master changed by a no-op write-back"

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases))


def test_settings_make_clipping_active() -> None:
    """The matrix's claim that clipping is active: the reference norms exceed the clip."""
    settings = TrainSettings()
    ref = reference_train(global_batches(0, 3, 4), "fp32", settings)
    assert min(ref.grad_norms) > settings.clip
