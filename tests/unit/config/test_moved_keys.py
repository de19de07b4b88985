"""Known moved and renamed config keys get a "moved to" hint, not a spelling guess (issue 30
item 10): DeepSpeed 0.19 keeps the gradient-accumulation dtype at data_types.grad_accum_dtype
(its runtime/config.py), and accelerate's DeepSpeedPlugin names map to DeepSpeed's paths."""

from __future__ import annotations

import pytest

from zeroshard.config.moved_keys import MOVED_KEYS
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

# A valid value at each table target, and the config around it that makes it valid.
TARGET_CONFIGS = {
    "data_types.grad_accum_dtype": {"data_types": {"grad_accum_dtype": "fp32"}},
    "zero_optimization.stage": {"zero_optimization": {"stage": 2}},
    "zero_optimization.offload_optimizer.device": {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
    "zero_optimization.offload_param.device": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": {
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}},
}


def test_gradient_accumulation_dtype_points_at_data_types():
    with pytest.raises(ConfigError) as info:
        resolve_config({"gradient_accumulation_dtype": "fp32"})
    (problem,) = info.value.problems
    assert problem == (
        "gradient_accumulation_dtype: unknown key. Moved to 'data_types.grad_accum_dtype' "
        "(the seed PR's top-level name)."
    )
    assert "gradient_accumulation_steps" not in problem


def test_a_moved_key_is_only_recognised_at_its_old_path():
    # Under data_types the same word is an ordinary typo of a sibling: a spelling guess.
    with pytest.raises(ConfigError, match=r"^data_types\.gradient_accumulation_dtype: unknown key\. Did you mean"):
        resolve_config({"data_types": {"gradient_accumulation_dtype": "fp32"}})


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_every_moved_key_is_refused_with_its_target(old):
    with pytest.raises(ConfigError) as info:
        resolve_config({old: 1})
    assert f"{old}: unknown key. Moved to '{MOVED_KEYS[old].to}'" in str(info.value)
    assert "Did you mean" not in str(info.value)


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_every_target_is_a_key_the_config_accepts(old):
    # So the table cannot point at a path that is itself unknown.
    target = MOVED_KEYS[old].to
    resolve_config(TARGET_CONFIGS[target])
