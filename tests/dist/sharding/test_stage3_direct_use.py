"""A stage-3 unit's parameter used as a bare tensor outside the unit is gathered where it is
used (issue 13 item 2; zeroshard/sharding/direct_use.py; docs/reliability.md).

DirectUseModel (tests/dist/scenarios/direct_use.py) computes TinyModel's function with three
direct uses: the root computes block 0 from its parameters (`addmm(b, normed, w.T)`), block
1's forward computes block 2 (`F.linear(x, blocks[2].fc.weight)`), and the head, tied to an
embedding that is a unit of its own, is read by the root. World 2, 2 optimizer steps, checked:

- against the one-process fp32 (or bf16-cast) TinyModel reference, with
  reference.TOLERANCES (fp32: 1e-6 absolute on the parameters, the engine only adds the same
  numbers in another order; bf16: the stated bf16 bounds, 8-bit mantissas);
- against stage 0 on the same model: bitwise in fp32 and bf16 with one micro-step per step
  (each unit's gradient is complete before it is reduced, so the stages sum the same numbers
  in the same order, docs/design.md section 5); with gradient accumulation 2, stage 3 reduces every
  micro-step (another order), so 1e-6 absolute;
- with reentrant and non-reentrant activation checkpointing of the code holding the direct
  uses: bitwise the stage-3 run without checkpointing (the recomputation repeats the same
  arithmetic);
- a backward through a retained graph, after the first backward released the units: bitwise
  stage 2 doing the same;
- a use before the unit's own forward runs (`h @ blocks[1].fc.weight.T`; its gradient arrives
  after the unit was reduced): stage 0 within 1e-6 (that late share is reduced separately, so sums differ in order);
- an eval forward under `torch.no_grad()` gives stage 0's logits bitwise, and no unit stays
  gathered after training or after the eval forward (no pin outlives its backward);
- a forward whose loss is dropped, then `empty_partition_cache()` between a forward and its
  backward (every pin released: the backward gathers again where the direct uses' outputs get
  their gradient): the reduced gradients are stage 0's, bitwise, and nothing stays gathered;
- a direct use on one rank only is an error after the collective timeout naming the unit,
  not a hang (the use is a collective, like every stage-3 gather).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import check_against_reference, flat_cat, reference_for, run_all, world_losses
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.direct_use import (
    UNITS_WITH_EMBEDDING,
    rank0_only_direct_use,
    run_direct_use_cases,
    unused_forward_and_released_pins,
)

KEEP = ("master", "grad0")
STEPS = 2
FP32_ATOL = 1e-6  # reference.TOLERANCES["fp32"].param_atol: same numbers summed in another order


def _case(stage: int, mode: str = "fp32", ga: int = 1, style: str = "engine", **model_kwargs) -> Case:
    variant = "-".join(f"{k}={v}" for k, v in model_kwargs.items())
    return Case(
        stage=stage, mode=mode, ga=ga, style=style, steps=STEPS, extra=UNITS_WITH_EMBEDDING, keep=KEEP,
        model_kwargs=model_kwargs, variant=variant,
    )


CASES = [
    *(_case(stage, mode) for mode in ("fp32", "bf16") for stage in (0, 3)),
    _case(0, ga=2),
    _case(3, ga=2),
    _case(3, checkpointing="reentrant"),
    _case(3, checkpointing="non_reentrant"),
    _case(0, style="retained"),
    _case(1, style="retained"),
    _case(2, style="retained"),
    _case(3, style="retained"),
    _case(0, early_use=True),
    _case(3, early_use=True),
]


@pytest.fixture(scope="module")
def results(dist_pool):
    return dist_pool(2).run(run_direct_use_cases, CASES, timeout=300)


def _index(stage: int, mode: str = "fp32", ga: int = 1, style: str = "engine", **model_kwargs) -> int:
    return CASES.index(_case(stage, mode, ga, style, **model_kwargs))


def test_direct_uses_match_the_reference(results) -> None:
    def check(index: int, case: Case):
        def run() -> None:
            ref = reference_for(case, 2)
            check_against_reference(results[0][index], ref, case.mode, case.settings, world_losses(results, index),
                                    case.label)

        return run

    compared = [i for i, c in enumerate(CASES) if c.style == "engine" and not c.model_kwargs.get("early_use")]
    run_all((CASES[i].label, check(i, CASES[i])) for i in compared)


def _same(a: dict, b: dict, atol: float | None) -> None:
    assert len(a["master"]) == len(b["master"])
    pairs = [(flat_cat(x), flat_cat(y)) for x, y in zip(a["master"], b["master"], strict=True)]
    pairs.append((flat_cat(a["grad0"]), flat_cat(b["grad0"])))
    for step, (x, y) in enumerate(pairs):
        if atol is None:
            assert torch.equal(x, y), f"item {step}: max diff {(x - y).abs().max():.3e}"
        else:
            torch.testing.assert_close(x, y, atol=atol, rtol=0, msg=lambda m, s=step: f"item {s}: {m}")


def test_stage3_matches_stage0(results) -> None:
    pairs = [
        ("fp32", _index(3), _index(0), None),
        ("bf16", _index(3, "bf16"), _index(0, "bf16"), None),
        ("ga2", _index(3, ga=2), _index(0, ga=2), FP32_ATOL),
        # Stages 2 and 3 reduce every backward in the same order: bitwise. Stages 0 and 1 must
        # not add the second backward into the first one's param.grad views (grad_views.py):
        # all-reduce against reduce-scatter sums in another order, hence the fp32 tolerance.
        ("retained graph", _index(3, style="retained"), _index(2, style="retained"), None),
        ("retained graph, stage 0", _index(0, style="retained"), _index(2, style="retained"), FP32_ATOL),
        ("retained graph, stage 1", _index(1, style="retained"), _index(2, style="retained"), FP32_ATOL),
        ("use before the unit's forward", _index(3, early_use=True), _index(0, early_use=True), FP32_ATOL),
    ]

    def check(i3: int, i0: int, atol):
        def run() -> None:
            for rank in range(2):
                _same(results[rank][i3], results[rank][i0], atol)

        return run

    run_all((label, check(i3, i0, atol)) for label, i3, i0, atol in pairs)


def test_checkpointed_direct_uses_match_the_plain_stage3_run(results) -> None:
    plain = results[0][_index(3)]
    for kind in ("reentrant", "non_reentrant"):
        run = results[0][_index(3, checkpointing=kind)]
        assert run["losses"] == plain["losses"], kind
        _same(run, plain, None)


def test_eval_under_no_grad_and_nothing_stays_gathered(results) -> None:
    for index, case in enumerate(CASES):
        for rank in range(2):
            result = results[rank][index]
            assert result["gathered_after_training"] == [], (case.label, result["gathered_after_training"])
            assert result["gathered_after_eval"] == [], (case.label, result["gathered_after_eval"])
    for mode in ("fp32", "bf16"):
        logits3, logits0 = results[0][_index(3, mode)]["eval_logits"], results[0][_index(0, mode)]["eval_logits"]
        assert logits3.shape == (2, 6, 13) and torch.equal(logits3, logits0), mode


def test_dropped_forward_and_released_pins_give_stage0_gradients(dist_pool) -> None:
    for rank, result in enumerate(dist_pool(2).run(unused_forward_and_released_pins, timeout=300)):
        assert result[3]["gathered"] == [], (rank, result[3]["gathered"])
        for name, grad in result[0]["grads"].items():
            assert torch.equal(result[3]["grads"][name], grad), (rank, name)


def test_a_direct_use_on_one_rank_only_is_named_on_both_ranks(dist_pool) -> None:
    """Rank 0 alone reads blocks[0].weight in a forward; its gather waits for rank 1, which
    never joins (it sleeps outside zeroshard): the hang watchdog raises HangError on both ranks,
    well before the collective timeout, with one diagnosis naming the gather, its unit and rank
    1's whereabouts (docs/reliability.md)."""
    timeout_s = 10.0
    case = Case(stage=3, extra={"zeroshard": {
        "collective_timeout_s": timeout_s, "hang_timeout_s": 2, "hang_first_step_timeout_s": 2}})
    rank0, rank1 = dist_pool(2).run(rank0_only_direct_use, case, 60.0, timeout=120)
    assert rank0["type"] == rank1["type"] == "HangError", (rank0, rank1)
    assert "all_gather 'param' over ranks [0, 1] at step 0, unit 'blocks.0'" in rank0["message"], rank0
    assert rank0["diagnosis"] == rank1["diagnosis"], (rank0, rank1)
    assert "unit 'blocks.0'" in rank0["diagnosis"] and "rank 1 is alive but outside zeroshard" in rank0["diagnosis"]
    # hang_timeout_s (2 s) plus a few ticks: below the collective timeout, far below rank 1's 60 s sleep.
    assert rank0["seconds"] < timeout_s and rank1["seconds"] < timeout_s + 2, (rank0, rank1)
