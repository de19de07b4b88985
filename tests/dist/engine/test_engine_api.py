"""DeepSpeed's engine methods in DeepSpeed users' loops, stages 0-3, 2 ranks.

* `engine.scale(loss).backward()` gives bitwise the update of `engine.backward(loss)` (fp16:
  the engine does not scale such a backward a second time; a scale 256x too large would show
  in every gradient), also alternated with plain `loss.backward()`.
* `engine.backward(loss / k, scale_wrt_gas=False)` gives bitwise the default loop's update
  (k = 2: dividing and multiplying by 2 is exact).
* `managed_gradient_accumulation: false`: k backwards then one `step()` is one update with the
  sum of the k gradients over world x k, as the one-process reference computes it.
* `with engine.coalesce_grad_reduction():` two backwards, no gradient collective inside, one
  reduction on exit: the update of the summed gradient, as the reference computes it (1-3).
* `was_step_applied`, `global_samples`, the config queries, `empty_partition_cache`, `destroy`.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import check_against_reference, flat_cat, reference_for, run_all, world_losses
from tests.dist.scenarios.common import Case

STAGES = (0, 1, 2, 3)
TIMEOUT_S = 600
STYLES = ("engine", "scaled", "scaled_then_plain", "no_gas_scaling", "unmanaged")


def api_cases() -> list[Case]:
    cases = []
    for mode in ("fp32", "fp16"):
        for stage in STAGES:
            for style in STYLES:
                extra = {"managed_gradient_accumulation": False} if style == "unmanaged" else {}
                cases.append(Case(stage=stage, mode=mode, ga=2, steps=2, style=style, extra=extra,
                                  keep=("master",) if style == "unmanaged" else ("master", "grad0")))
            if stage > 0:  # coalesce_grad_reduction: ZeRO 1-3, two backwards per step
                cases.append(Case(stage=stage, mode=mode, ga=1, steps=2, style="coalesce", keep=("master", "grad0")))
    return cases


@pytest.fixture(scope="module")
def api_results(dist_pool):
    from tests.dist.scenarios.engine_api import run_api_cases

    cases = api_cases()
    return cases, dist_pool(2).run(run_api_cases, cases, timeout=TIMEOUT_S)


def test_each_loop_matches_the_reference(api_results) -> None:
    cases, per_rank = api_results

    def check(index: int, case: Case):
        def run() -> None:
            ref = reference_for(case, 2, loss_terms=2 if case.style == "coalesce" else 1)
            check_against_reference(per_rank[0][index], ref, case.mode, case.settings,
                                    world_losses(per_rank, index), case.label)

        return run

    run_all((case.label, check(i, case)) for i, case in enumerate(cases) if case.style != "engine")


def test_scale_and_scale_wrt_gas_match_engine_backward_bitwise(api_results) -> None:
    cases, per_rank = api_results
    baseline = {(c.mode, c.stage): i for i, c in enumerate(cases) if c.style == "engine"}

    def check(index: int, case: Case):
        def run() -> None:
            base, result = per_rank[0][baseline[(case.mode, case.stage)]], per_rank[0][index]
            assert result["losses"] == base["losses"]
            assert result["loss_scales"] == base["loss_scales"]
            assert result["grad_norms"] == base["grad_norms"], "grad norms differ"
            assert torch.equal(flat_cat(result["grad0"]), flat_cat(base["grad0"])), "first-step gradients differ"
            for step in range(2):
                assert torch.equal(flat_cat(result["master"][step]), flat_cat(base["master"][step])), step

        return run

    run_all((c.label, check(i, c)) for i, c in enumerate(cases) if c.style in ("scaled", "scaled_then_plain",
                                                                                "no_gas_scaling"))


def test_fp16_loss_scale_is_in_force(api_results) -> None:
    """The runs use 2**8 (reference.FP16_INITIAL_SCALE_POWER); no step was skipped."""
    cases, per_rank = api_results
    for index, case in enumerate(cases):
        if case.mode == "fp16":
            assert per_rank[0][index]["loss_scales"] == [2.0**8] * 2, case.label
            assert per_rank[0][index]["skipped"] == [0, 0], case.label


@pytest.fixture(scope="module")
def counter_results(dist_pool):
    return {stage: dist_pool(2).run(_counter_task, stage, timeout=TIMEOUT_S)[0] for stage in STAGES}


def _counter_task(stage: int):
    from tests.dist.scenarios.engine_api import counters, partition_cache_and_destroy

    return counters(stage), partition_cache_and_destroy(stage)


@pytest.mark.parametrize("stage", STAGES)
def test_was_step_applied_and_global_samples(counter_results, stage) -> None:
    out, _ = counter_results[stage]
    # 3 steps of 2 micro-steps; the second step's boundary micro-step overflows.
    assert out["applied"] == [False, True, False, False, False, True]
    assert out["skipped"] == 1
    train_batch = 2 * 2 * 2  # micro 2 x accumulation 2 x 2 ranks
    assert out["samples"] == [0, train_batch, train_batch, 2 * train_batch, 2 * train_batch, 3 * train_batch]
    assert out["queries"] == (True, False, stage, 1.0, True)
    # Unmanaged: 3 backwards of micro-batch 2 on 2 ranks, then one step that is the boundary.
    assert out["unmanaged"] == (3 * 2 * 2, 1, True, 1)


@pytest.mark.parametrize("stage", STAGES)
def test_empty_partition_cache_changes_nothing_and_destroy_unhooks(counter_results, stage) -> None:
    _, out = counter_results[stage]
    for step in range(2):
        assert torch.equal(flat_cat(out["emptied"][step]), flat_cat(out["plain"][step])), step
    assert out["states_after"] == (["sharded"] if stage == 3 else ["unsharded"])
    if stage < 3:
        assert out["grads"] and all(out["grads"])


@pytest.mark.parametrize("stage", STAGES)
def test_zero_init_builds_a_model_that_trains_as_without_it(dist_pool, stage) -> None:
    out = dist_pool(2).run("tests.dist.scenarios.engine_api:zero_init", stage, timeout=TIMEOUT_S)[0]
    assert out["stage"] == stage
    for step in range(2):
        assert torch.equal(flat_cat(out["inside"][step]), flat_cat(out["plain"][step])), step
    # Stage 3: between steps every trainable parameter is a shard only (its full storage empty).
    assert out["empty_storage"] == ([True] if stage == 3 else [False])


def test_zero_init_checks_its_config() -> None:
    import zeroshard

    with pytest.raises(zeroshard.DeepSpeedConfigError, match="stage"):
        zeroshard.zero.Init(config_dict_or_path={"zero_optimization": {"stage": "3"}})
    with zeroshard.zero.Init(enabled=False, config_dict_or_path={"zero_optimization": {"stage": "3"}}) as ctx:
        assert ctx.config is None
