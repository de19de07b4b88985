"""DeepSpeed names a script imports: DeepSpeedConfigError at both paths, add_config_arguments,
and the DeepSpeed 0.19 config keys zeroshard reads (param_dtype, gradient_allreduce_op,
log_level, expert_parallel, datastates_ckpt)."""

import argparse

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config
from zeroshard.runtime.config import DeepSpeedConfigError


def test_config_error_is_caught_by_both_names():
    assert DeepSpeedConfigError is deepspeed.DeepSpeedConfigError
    assert issubclass(DeepSpeedConfigError, ConfigError)
    bad = {"zero_optimization": {"stage": "2"}}
    with pytest.raises(DeepSpeedConfigError, match=r'zero_optimization.stage="2": must be an integer'):
        resolve_config(bad)
    with pytest.raises(ConfigError):
        resolve_config(bad)
    with pytest.raises(ValueError):
        resolve_config(bad)


def test_initialize_raises_deepspeed_config_error():
    model = nn.Linear(2, 2)
    with pytest.raises(DeepSpeedConfigError, match="unknown key"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                             config={"train_batch_size": 1, "zero_optimisation": {}})
    with pytest.raises(DeepSpeedConfigError, match="no config"):
        deepspeed.initialize(model=model, dist_init_required=False)


def test_a_precision_rule_across_sections_raises_it_too():
    with pytest.raises(DeepSpeedConfigError, match="pick one precision"):
        resolve_config({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_add_config_arguments_feeds_initialize(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}}}')
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    args = deepspeed.add_config_arguments(parser).parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True and args.deepscale is False and args.deepscale_config is None
    model = nn.Linear(2, 2)
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(),
                                                   dist_init_required=False)
    assert engine.train_micro_batch_size_per_gpu() == 2
    assert optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize(
    "config",
    [{"data_types": {"param_dtype": "bf16"}, "bf16": {"enabled": True}},
     {"data_types": {"param_dtype": "fp16"}, "fp16": {"enabled": True}},
     {"data_types": {"param_dtype": "float32"}},
     {"gradient_allreduce_op": "mean"},
     {"expert_parallel": {"enabled": False}},
     {"datastates_ckpt": {}}],
)
def test_deepspeed_019_keys_accepted_when_they_ask_for_what_zeroshard_does(config):
    resolve_config(config)


@pytest.mark.parametrize(
    "config, message",
    [({"data_types": {"param_dtype": "bf16"}}, r'data_types.param_dtype="bf16": must match the enabled precision '
      r"mode, whose parameters are fp32"),
     ({"data_types": {"param_dtype": "fp16"}, "bf16": {"enabled": True}}, "whose parameters are bf16"),
     ({"gradient_allreduce_op": "sum"}, r'gradient_allreduce_op="sum": recognised DeepSpeed key, not supported'),
     ({"expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}},
          r"expert_parallel.expert_tensor_parallel_size=2: recognised DeepSpeed key, not supported"),
     ({"datastates_ckpt": {"enabled": True}}, "datastates_ckpt")],
)
def test_deepspeed_019_keys_refused_when_they_ask_for_something_else(config, message):
    with pytest.raises(DeepSpeedConfigError, match=message):
        resolve_config(config)


def test_log_level_is_accepted_with_no_effect():
    with pytest.warns(UserWarning, match="log_level"):
        cfg = resolve_config({"log_level": "debug"})
    assert "log_level" in cfg.no_effect_keys
    assert torch.get_default_dtype() == torch.float32
