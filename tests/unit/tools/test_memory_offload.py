"""The memory estimate and `explain` with ZeRO-Offload: where each role lives and the
per-rank device and host bytes, counted by hand for a small case (P = 1000, W = 2, so a
shard is 500 elements)."""

from __future__ import annotations

import json

import pytest

from zeroshard.precision.plan import resolve_precision_plan
from zeroshard.resolve import resolve_config
from zeroshard.tools.explain import explain_text
from zeroshard.tools.memory import estimate_memory

P, W, SHARD = 1000, 2, 500


def plan_for(raw):
    return resolve_precision_plan(resolve_config(raw))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_offload_moves_master_and_adam_state_to_the_host(stage):
    plan = plan_for({"bf16": {"enabled": True}})
    none = estimate_memory(plan, stage, W, P)
    off = estimate_memory(plan, stage, W, P, offload_optimizer=True, pin_memory=True)
    master, state, landing = SHARD * 4, 2 * SHARD * 4, SHARD * 4  # fp32 master, 2 fp32 Adam states
    assert off.placement == {"params": "device", "gradients": "device", "master_weights": "host",
                             "optimizer_state": "host"}
    # Stage 3 without offload gathers by casting the device master and keeps no bf16
    # parameter shard; with the master on the host the device keeps that shard again.
    param_shard = SHARD * 2 if stage == 3 else 0
    assert none.host_bytes == 0
    assert off.device_bytes == none.device_bytes - master - state + param_shard
    assert off.host_bytes == master + state + landing
    assert off.host_buffers == {"grad_landing": landing} and off.pinned


def test_fp32_offload_keeps_a_master_copy_of_its_own_on_the_host():
    plan = plan_for({})  # fp32: without offload the masters are the parameters
    none = estimate_memory(plan, 2, W, P)
    off = estimate_memory(plan, 2, W, P, offload_optimizer=True)
    assert none.model_states["master_weights"] == 0
    assert off.model_states["master_weights"] == SHARD * 4
    assert off.host_bytes == SHARD * 4 + 2 * SHARD * 4 + SHARD * 4
    assert off.device_bytes == none.device_bytes - 2 * SHARD * 4
    assert not off.pinned


def test_stage3_param_offload_puts_the_parameter_shard_on_the_host():
    plan = plan_for({})
    both = estimate_memory(plan, 3, W, P, offload_optimizer=True, offload_param=True)
    assert both.placement["params"] == "host"
    # fp32 with both offloaded: the host parameter shard is the master (no copy).
    assert both.model_states["master_weights"] == 0
    assert both.host_bytes == SHARD * 4 + 2 * SHARD * 4 + SHARD * 4
    assert estimate_memory(plan, 2, W, P, offload_param=True).placement["params"] == "device"


def test_explain_shows_where_each_role_lives(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "cpu"}},
    }))
    text = explain_text(str(path), world_size=W, params=P)
    assert "master_weights host" in text and "optimizer_state host" in text
    assert "params host (shard; gathered on the device)" in text
    rows = {line.split("│")[1].strip(): line for line in text.splitlines() if line.count("│") >= 3}
    assert "host" in rows["master_weights"] and "device" in rows["gradients"]
    assert "grad_landing (pinned)" in rows and "host total" in rows and "device total" in rows
