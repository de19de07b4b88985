"""Config forms DeepSpeed reads (issue 19 item 6): ZeRO's stage3_-less aliases, the legacy
"bfloat16" section, fp16 dynamic-scaling knobs beside a static scale or with fp16 off, the batch
triangle from the micro-batch and accumulation steps alone, and checkpoint.tag_validation."""

import warnings

import pytest
import torch

import zeroshard
import zeroshard.config.schema as config_module
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def test_param_persistence_threshold_is_deepspeeds_alias():
    cfg = resolve_config({"zero_optimization": {"stage": 3, "param_persistence_threshold": 1234}})
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 1234
    assert "zero_optimization.stage3_param_persistence_threshold" not in cfg.defaults_applied
    cfg = resolve_config({"zero_optimization": {"prefetch_bucket_size": 5e7, "max_live_parameters": 1e9}})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 50_000_000


def test_alias_and_its_field_together_is_an_error():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            {"zero_optimization": {"param_persistence_threshold": 5, "stage3_param_persistence_threshold": 5}}
        )
    assert info.value.problems == [
        "zero_optimization.param_persistence_threshold=5: DeepSpeed's other name for "
        "'zero_optimization.stage3_param_persistence_threshold', which is given too. Keep one of them."
    ]


def test_alias_errors_name_the_key_as_written():
    with pytest.raises(ConfigError) as info:
        resolve_config({"zero_optimization": {"param_persistence_threshold": "10"}})
    assert info.value.problems == [
        'zero_optimization.param_persistence_threshold="10": must be an integer. Write 10 without quotes.'
    ]


def test_persistence_threshold_alias_reaches_the_engine():
    """The threshold decides which stage-3 units stay resident: given by its alias it does too."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"zero_optimization": {"stage": 3, "param_persistence_threshold": 0},
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    assert engine.config.zero_optimization.stage3_param_persistence_threshold == 0
    assert not any(flat.policy.keep_full_params for flat in engine.flats)


def test_legacy_bfloat16_section():
    cfg = resolve_config({"bfloat16": {"enabled": True}})
    assert cfg.bf16.enabled and cfg.precision_plan.mode == "bf16"
    assert "bf16.enabled" not in cfg.defaults_applied
    with pytest.raises(ConfigError, match=r"^bfloat16\.enabeld: unknown key\. Did you mean 'enabled'\?$"):
        resolve_config({"bfloat16": {"enabeld": True}})
    with pytest.raises(ConfigError, match=r'^bfloat16\.enabled="yes": must be true or false'):
        resolve_config({"bfloat16": {"enabled": "yes"}})
    with pytest.raises(ConfigError, match=r"^bfloat16=.*DeepSpeed's other name for 'bf16', which is given too"):
        resolve_config({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


@pytest.mark.parametrize(
    "fp16",
    [
        {"enabled": True, "loss_scale": 128, "loss_scale_window": 100, "min_loss_scale": 0.5},
        {"enabled": False, "loss_scale_window": 100, "min_loss_scale": 0.5},
    ],
)
def test_dynamic_scaling_knobs_with_a_static_scale_or_fp16_off_are_accepted_with_no_effect(fp16, monkeypatch):
    monkeypatch.setattr(config_module, "_warned_no_effect", set())  # the warning is once per process
    with pytest.warns(UserWarning, match="change nothing here: fp16.loss_scale_window, fp16.min_loss_scale"):
        cfg = resolve_config({"fp16": fp16})
    assert cfg.no_effect_keys == ["fp16.loss_scale_window", "fp16.min_loss_scale"]
    expected_kind = "static" if fp16["enabled"] else "none"
    assert cfg.precision_plan.loss_scale.kind == expected_kind
    # With dynamic scaling they are supported settings, not listed.
    dynamic = resolve_config({"fp16": {"enabled": True, "loss_scale_window": 100, "min_loss_scale": 0.5}})
    assert dynamic.no_effect_keys == [] and dynamic.precision_plan.loss_scale.window == 100


def test_static_scale_engine_keeps_its_scale():
    model = torch.nn.Linear(4, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine, *_ = zeroshard.initialize(
            model=model, model_parameters=model.parameters(), dist_init_required=False,
            config={"fp16": {"enabled": True, "loss_scale": 64, "loss_scale_window": 2, "min_loss_scale": 0.5},
                    "optimizer": {"type": "SGD", "params": {"lr": 0.0}}},
        )
    for _ in range(4):  # more clean steps than the window: a dynamic scale would have grown
        engine.backward(engine(torch.randn(2, 4, dtype=torch.float16)).float().sum())
        engine.step()
    assert engine.loss_scale == 64


def test_micro_batch_and_accumulation_alone_derive_the_batch():
    model = torch.nn.Linear(4, 2)
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}},
    )
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (15, 3, 5)
    assert engine.config.derived_keys == ["train_batch_size"]
    assert resolve_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5},
                       world_size=4).train_batch_size == 60


@pytest.mark.parametrize("written, stored", [("Ignore", "Ignore"), ("WARN", "Warn"), ("fail", "Fail")])
def test_checkpoint_tag_validation(written, stored):
    cfg = resolve_config({"checkpoint": {"tag_validation": written}})
    assert cfg.checkpoint.tag_validation == stored
    assert "checkpoint.tag_validation" not in cfg.no_effect_keys


def test_checkpoint_tag_validation_default_and_errors():
    assert resolve_config({}).checkpoint.tag_validation == "Warn"  # DeepSpeed's default
    with pytest.raises(ConfigError, match=r"^checkpoint\.tag_validation=\"Sometimes\": Input should be 'Ignore', "):
        resolve_config({"checkpoint": {"tag_validation": "Sometimes"}})
    with pytest.raises(ConfigError, match=r"^checkpoint\.tag_validaton: unknown key\. Did you mean 'tag_validation'"):
        resolve_config({"checkpoint": {"tag_validaton": "Warn"}})
    assert resolve_config({"checkpoint": {"load_universal": True}}).checkpoint.load_universal is True
    cfg = resolve_config({"checkpoint": {"use_node_local_storage": False, "load_universal": False}})
    assert cfg.no_effect_keys == ["checkpoint.use_node_local_storage"]


def test_resolved_config_is_frozen():
    cfg = resolve_config({"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="frozen"):
        cfg.gradient_clipping = 2.0
    with pytest.raises(ValueError, match="frozen"):
        cfg.zero_optimization.stage = 3
    assert cfg.stage_policy.stage == 2 and cfg.stage_policy.reduce_every_backward
