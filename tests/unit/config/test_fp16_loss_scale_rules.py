"""fp16 loss-scale validation as DeepSpeed 0.19's own tests assert it
(tests/unit/runtime/test_precision_config_{loss_scale,dynamic_scale}.py in its repository).

The outcomes below are DeepSpeed's (observed with DeepSpeed 0.19.8's DeepSpeedFP16Config). One
case differs on purpose: DeepSpeed coerces the string "3" to 3.0, zeroshard's strict reading
refuses it (docs/migrating-from-deepspeed.md, "Strict config reading").
"""

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

KNOBS = ("loss_scale_window", "min_loss_scale")


def _fp16(**fp16):
    return resolve_config({"train_batch_size": 1, "fp16": fp16}).fp16


@pytest.mark.parametrize("field", KNOBS)
@pytest.mark.parametrize("value", [0, -1, True, False, float("inf"), float("nan"), "abc", None])
def test_dynamic_scaling_refuses_a_knob_it_cannot_use(field, value):
    with pytest.raises(ConfigError, match=rf"fp16\.{field}="):
        _fp16(enabled=True, loss_scale=0, **{field: value})


@pytest.mark.parametrize("field", KNOBS)
@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.filterwarnings("ignore:zeroshard accepts these DeepSpeed keys")
@pytest.mark.parametrize("settings", [{"enabled": True, "loss_scale": 128}, {"enabled": False, "loss_scale": 0}])
def test_knobs_beside_a_static_scale_or_fp16_off_are_accepted_as_written(field, value, settings):
    # DeepSpeed: unused there, so a non-positive value must not fail (its compatibility rule).
    cfg = resolve_config({"train_batch_size": 1, "fp16": {**settings, field: value}})
    assert getattr(cfg.fp16, field) == value
    assert f"fp16.{field}" in cfg._no_effect_keys  # listed (and warned once) as accepted, no effect


@pytest.mark.parametrize("field", KNOBS)
def test_positive_knobs_are_accepted_with_dynamic_scaling(field):
    for value in (1, 1000):
        assert getattr(_fp16(enabled=True, loss_scale=0, **{field: value}), field) == value


@pytest.mark.parametrize("value", [-1, float("inf"), float("nan"), True, [], {}])
def test_invalid_loss_scale_is_refused(value):
    with pytest.raises(ConfigError, match=r"fp16\.loss_scale=") as info:
        _fp16(loss_scale=value)
    if isinstance(value, (list, dict)):
        assert "must be a number" in str(info.value)  # DeepSpeed's wording for a wrong type


@pytest.mark.parametrize("value", [0, 1, 2.0])
def test_valid_loss_scale_is_kept(value):
    assert _fp16(loss_scale=value).loss_scale == float(value)
