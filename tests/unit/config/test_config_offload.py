"""ZeRO-Offload's config keys: DeepSpeed's spellings accepted, what is not implemented refused
naming the key (zeroshard/config/offload.py)."""

from __future__ import annotations

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def resolve(zero: dict):
    return resolve_config({"train_batch_size": 2, "zero_optimization": zero}, world_size=2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_optimizer_at_stages_1_to_3(stage):
    zero = resolve({"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 1.0}})
    z = zero.zero_optimization
    assert z.optimizer_offload and z.offload_pin_memory and not z.param_offload


def test_offload_param_at_stage_3_and_the_legacy_booleans():
    z = resolve({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}})
    assert z.zero_optimization.param_offload and z.zero_optimization.optimizer_offload
    assert not z.zero_optimization.offload_pin_memory  # DeepSpeed's default: not pinned
    legacy = resolve({"stage": 3, "cpu_offload": True, "cpu_offload_param": True}).zero_optimization
    assert legacy.optimizer_offload and legacy.param_offload
    off = resolve({"stage": 2, "offload_optimizer": {"device": "none"}, "cpu_offload": False}).zero_optimization
    assert not off.optimizer_offload and not off.param_offload


@pytest.mark.parametrize(
    "zero, message",
    [
        ({"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
         r'^zero_optimization\.offload_optimizer\.device="nvme": offloading to NVMe'),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, r'^zero_optimization\.offload_param\.device="nvme"'),
        ({"stage": 2, "offload_optimizer": {"device": "gpu"}}, r'^zero_optimization\.offload_optimizer\.device="gpu"'),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}},
         r"^zero_optimization\.offload_optimizer\.ratio=0\.3: a partial offload"),
        ({"stage": 0, "offload_optimizer": {"device": "cpu"}},
         r"^zero_optimization\.offload_optimizer: offloading the optimizer needs ZeRO stage 1, 2 or 3"),
        ({"stage": 0, "cpu_offload": True}, r"^zero_optimization\.cpu_offload: offloading the optimizer"),
        ({"stage": 2, "offload_param": {"device": "cpu"}},
         r"^zero_optimization\.offload_param: offloading parameters needs ZeRO stage 3 \(stage is 2\)"),
        ({"stage": 1, "cpu_offload_param": True}, r"^zero_optimization\.cpu_offload_param: offloading parameters"),
        ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}},
         r"^zero_optimization\.cpu_offload=true: DeepSpeed's old name for offload_optimizer"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu", "sub_group": 1}},
         r"^zero_optimization\.offload_optimizer\.sub_group: unknown key"),
    ],
)
def test_refused_naming_the_key(zero, message):
    with pytest.raises(ConfigError, match=message):
        resolve(zero)


def test_nvme_knobs_are_accepted_with_no_effect_under_cpu():
    with pytest.warns(UserWarning, match=r"offload_optimizer\.buffer_count"):
        cfg = resolve({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 8, "fast_init": False}})
    assert "zero_optimization.offload_optimizer.buffer_count" in cfg.no_effect_keys
    assert "zero_optimization.offload_optimizer.fast_init" in cfg.no_effect_keys
