"""The memory estimator against the ZeRO paper's formulas and our mechanism's buffers.

All comparisons are exact: the estimator does integer arithmetic on element counts, and the
parameter counts below are multiples of W wherever a formula divides by W.
"""

import pytest

from zeroshard.precision.plan import resolve_precision_plan
from zeroshard.resolve import resolve_config
from zeroshard.tools.memory import (
    bytes_per_param,
    estimate_for_config,
    estimate_memory,
    optimizer_state_count,
    padded_shard_numel,
    zero_paper_model_state_bytes,
)

P, W = 8_000_000, 8  # P divisible by W: no padding in the formula checks


def plan_for(raw):
    return resolve_precision_plan(resolve_config(raw))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_mixed_precision_adam_with_16bit_accumulation_is_the_zero_paper(low, stage):
    plan = plan_for({low: {"enabled": True}, "data_types": {"grad_accum_dtype": low}})
    estimate = estimate_memory(plan, stage, W, P)
    expected = {0: 16 * P, 1: 4 * P + 12 * P // W, 2: 2 * P + 14 * P // W}[stage]
    assert estimate.model_state_bytes == expected == zero_paper_model_state_bytes(stage, P, W)


@pytest.mark.parametrize("low", ["bf16", "fp16"])
def test_stage3_keeps_no_16bit_parameter_shard_beside_the_fp32_master(low):
    # The paper's 16P/W less the 2-byte parameter shard: each gather casts the fp32 master.
    plan = plan_for({low: {"enabled": True}, "data_types": {"grad_accum_dtype": low}})
    estimate = estimate_memory(plan, 3, W, P)
    assert estimate.model_states["params"] == 0
    assert estimate.model_state_bytes == 14 * P // W == zero_paper_model_state_bytes(3, P, W) - 2 * P // W
    assert bytes_per_param(plan, 3) == (0, 14)
    # With offload the master (or the gather's source) is on the host: the shard stays.
    offloaded = estimate_memory(plan, 3, W, P, offload_optimizer=True)
    assert offloaded.model_states["params"] == 2 * P // W
    assert bytes_per_param(plan, 3, offloaded=True) == (0, 16)


@pytest.mark.parametrize(
    "stage, expected",
    [(0, 18 * P), (1, 6 * P + 12 * P // W), (2, 2 * P + 16 * P // W), (3, 16 * P // W)],
)
def test_fp32_accumulation_adds_two_bytes_per_accumulated_element(stage, expected):
    plan = plan_for({"bf16": {"enabled": True}})  # zeroshard's default: fp32 accumulation
    estimate = estimate_memory(plan, stage, W, P)
    assert estimate.model_state_bytes == expected
    accumulated = P if stage < 2 else P // W
    assert estimate.model_states["gradients"] == 4 * accumulated


@pytest.mark.parametrize("raw", [{}, {"torch_autocast": {"enabled": True}}])
@pytest.mark.parametrize(
    "stage, expected",
    # params 4 + grads 4 + Adam states 8; no separate master copy
    [(0, 16 * P), (1, 8 * P + 8 * P // W), (2, 4 * P + 12 * P // W), (3, 16 * P // W)],
)
def test_master_weights_are_the_params_in_fp32_and_autocast(raw, stage, expected):
    estimate = estimate_memory(plan_for(raw), stage, W, P)
    assert estimate.model_states["master_weights"] == 0
    assert estimate.model_state_bytes == expected


def test_bf16_master_weights_and_optimizer_states():
    plan = plan_for({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}})
    estimate = estimate_memory(plan, 2, W, P)
    # params 2P + (grads 2 + master 2 + states 2*2) P/W
    assert estimate.model_state_bytes == 2 * P + 8 * P // W
    assert bytes_per_param(plan, 2) == (2, 8)


@pytest.mark.parametrize(
    "optimizer, params, states",
    [("Adam", {}, 2), ("AdamW", {"lr": 1}, 2), ("SGD", {}, 0), ("SGD", {"momentum": 0.9}, 1), ("Muon", {}, 1),
     (None, None, 2)],
)
def test_optimizer_state_counts(optimizer, params, states):
    assert optimizer_state_count(optimizer, params) == states


def test_sgd_without_momentum_keeps_no_state():
    plan = plan_for({"bf16": {"enabled": True}})
    estimate = estimate_memory(plan, 1, W, P, optimizer_states=0)
    assert estimate.model_states["optimizer_state"] == 0
    assert estimate.model_state_bytes == 2 * P + 4 * P + 4 * P // W


def test_padding_to_a_multiple_of_world_size_is_explicit():
    assert padded_shard_numel(10, 4) == 3
    assert padded_shard_numel(12, 4) == 3
    assert padded_shard_numel(1, 8) == 1
    plan = plan_for({"bf16": {"enabled": True}})
    estimate = estimate_memory(plan, 3, 4, 10)
    group = estimate.per_group["all"]
    assert (group["num_params"], group["padded_num_params"]) == (10, 12)
    # each rank holds a 3-element shard: fp32 grads, fp32 master, 2 fp32 states (no bf16
    # parameter shard: the gathers cast the master)
    assert estimate.model_states == {"params": 0, "gradients": 12, "master_weights": 12, "optimizer_state": 24}


def test_per_group_counts_in_autocast_mode():
    plan = plan_for({"torch_autocast": {"enabled": True}})
    estimate = estimate_memory(plan, 3, W, {"lower_precision_safe": 6_000_000, "other": 2_000_000})
    assert estimate.num_params == 8_000_000
    assert estimate.per_group["lower_precision_safe"]["params"] == 4 * 6_000_000 // W
    assert estimate.per_group["other"]["params"] == 4 * 2_000_000 // W
    assert estimate.model_state_bytes == 16 * 8_000_000 // W
    # autocast's bf16 copies of the safe parameters, saved for backward: the whole safe group,
    # on every rank, at every stage (W does not divide it).
    assert estimate.buffers["autocast_weight_copies"] == 2 * 6_000_000
    for stage in (0, 1, 2):
        assert estimate_memory(plan, stage, W, {"lower_precision_safe": 6_000_000}).buffers[
            "autocast_weight_copies"
        ] == 2 * 6_000_000
    with pytest.raises(ValueError, match="groups \\['all'\\]"):
        estimate_memory(plan, 3, W, {"all": 5})


def test_buffers_are_bounded_by_buckets_and_units():
    plan = plan_for({"bf16": {"enabled": True}})  # grads bf16, reduce fp32, gather bf16
    units = [1_000_000] * 7 + [50_000, 950_000]  # 8M in all; one small unit
    estimate = estimate_memory(
        plan, 3, W, P, unit_numels=units, reduce_bucket_size=500_000, prefetch_bucket_size=2_000_000,
        persistence_threshold=100_000,
    )
    assert estimate.buffers == {
        "grad_unit_buffer": 4 * 1_000_000,  # the largest unit's local gradient, fp32 accumulation
        "reduce_bucket": 4 * 2 * 500_000,  # fp32 on the wire, one bucket filling, one reducing
        "allgather_bucket": 0,
        "gathered_units": 2 * (2_000_000 + 1_000_000),  # prefetch + largest unit, bf16
        "resident_units": 2 * 50_000,
        "autocast_weight_copies": 0,  # not torch_autocast
    }
    assert estimate.total_bytes == estimate.model_state_bytes + estimate.buffer_bytes
    assert estimate.assumptions == []
    # A bucket larger than any unit fills across units: the buckets, not the unit, bound it,
    # and the model bounds the two buckets (8M elements < 2 x 5M).
    wide = estimate_memory(plan, 3, W, P, unit_numels=units, reduce_bucket_size=5_000_000)
    assert wide.buffers["reduce_bucket"] == 4 * 8_000_000
    stage1 = estimate_memory(plan, 1, W, P, allgather_bucket_size=3_000_000, reduce_bucket_size=10**9)
    assert stage1.buffers["allgather_bucket"] == 2 * 3_000_000
    assert stage1.buffers["reduce_bucket"] == 4 * P  # bucket larger than the model: the model bounds it
    assert stage1.buffers["grad_unit_buffer"] == 0
    assert stage1.assumptions  # no units given: one unit holding everything


def test_estimate_for_config_reads_stage_buckets_and_optimizer():
    cfg = resolve_config({
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "fp16": {"enabled": True, "loss_scale": 0},
        "data_types": {"grad_accum_dtype": "fp16"},
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
    }, world_size=W)
    estimate = estimate_for_config(cfg, resolve_precision_plan(cfg), P)
    assert (estimate.stage, estimate.world_size) == (2, W)
    # params 2P; grads 2 P/W; master 4 P/W; one fp32 momentum 4 P/W
    assert estimate.model_state_bytes == 2 * P + 10 * P // W
    assert estimate.buffers["reduce_bucket"] == 2 * 2 * 1000  # fp16 wire: one bucket filling, one reducing


def test_bad_arguments():
    plan = plan_for({})
    with pytest.raises(ValueError, match="stage=4"):
        estimate_memory(plan, 4, 1, 10)
    with pytest.raises(ValueError, match="world_size=0"):
        estimate_memory(plan, 1, 0, 10)
    with pytest.raises(ValueError, match="unknown to the memory estimator"):
        optimizer_state_count("Lamb")
