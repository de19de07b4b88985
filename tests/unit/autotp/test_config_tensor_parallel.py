"""The `tensor_parallel` section: DeepSpeed 0.19.8's keys (TPTrainingConfig, TPConfig), each
supported, accepted with no effect, or refused with its JSON path; and what it does not
combine with, refused by the resolve pass (so `explain` refuses it too)."""

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1}


def resolve(section, world=4, **extra):
    return resolve_config({**BASE, "tensor_parallel": section, **extra}, world_size=world)


def test_supported_keys_and_deepspeeds_batch_convention():
    with pytest.warns(UserWarning, match="tensor_parallel.tp_overlap_comm"):
        cfg = resolve({"autotp_size": 2, "preset_model": "llama", "tp_overlap_comm": True, "dtype": "bf16",
                       "tp": {"tp_size": 2, "tp_grain_size": 1}, "vocab_parallel_lm_head": False},
                      bf16={"enabled": True})
    tp = cfg.tensor_parallel
    assert (tp.size, tp.preset_model, tp.tp.tp_size) == (2, "llama", 2)
    assert "tensor_parallel.tp_overlap_comm" in cfg.no_effect_keys
    # DeepSpeed 0.19.8 (tensor_parallel from the config, no mpu) counts every rank in the
    # triangle, as the HF Trainer fills it: 2 x 1 x 4.
    assert cfg.train_batch_size == 8
    assert resolve({"autotp_size": 0}).tensor_parallel.size == 1
    assert resolve({"autotp_size": 2, "tensor_parallel": {"tp_size": 2}}).tensor_parallel.tp.tp_size == 2  # alias


@pytest.mark.parametrize("section, extra, message", [
    ({"autotp_size": 3}, {}, r"tensor_parallel.autotp_size=3: must divide the world size 4"),
    ({"autotp_size": 2, "preset_model": "gpt9"}, {}, r'preset_model="gpt9": unknown preset. Use one of llama'),
    ({"autotp_size": 2, "vocab_parallel_lm_head": True}, {}, r"vocab_parallel_lm_head=true: recognised DeepSpeed"),
    ({"autotp_size": 2, "vocab_parallel_ce_backend": "liger"}, {}, r'vocab_parallel_ce_backend="liger": recognised'),
    ({"autotp_size": 2, "tp": {"tp_size": 4}}, {}, r"tensor_parallel.tp.tp_size=4: must be 1 or equal"),
    ({"autotp_size": 2, "tp": {"tp_grain_size": 64}}, {}, r"tp.tp_grain_size=64: zeroshard splits every dimension"),
    ({"autotp_size": 2, "keep_module_on_host": True}, {}, r"keep_module_on_host=true: recognised DeepSpeed key"),
    ({"autotp_size": 2, "replace_with_kernel_inject": True}, {}, r"replace_with_kernel_inject=true: recognised"),
    ({"autotp_size": 2, "dtype": "fp16"}, {"bf16": {"enabled": True}},
     r"tensor_parallel.dtype='fp16': the config trains in bf16"),
    ({"autotp_size": 2, "partition_config": {"layer_specs": [{"patterns": ["(("], "partition_type": "diag"}],
                                             "foo": 1}}, {},
     r"partition_config.foo: unknown key(.|\n)*layer_specs.0.patterns: '\(\(' is not a regular expression(.|\n)*"
     r"layer_specs.0.partition_type='diag'"),
    ({"autotp_size": 2}, {"sequence_parallel_size": 2}, r"with sequence_parallel_size=2: tensor and sequence"),
    ({"autotp_size": 2}, {"expert_parallel": {"enabled": True, "autoep_size": 2}}, r"with expert_parallel.enabled"),
    ({"autotp_size": 2}, {"zeroshard": {"shard_group_size": 2}}, r"with zeroshard.shard_group_size=2: hybrid"),
    ({"autotp_size": 2}, {"optimizer": {"type": "Muon", "params": {"lr": 0.01}}}, r"optimizer.type='Muon': Muon"),
    ({"autotp_size": 2, "unknown_key": 1}, {}, r"tensor_parallel.unknown_key: unknown key"),
    ({"autotp_size": 2}, {"zeroshard": {"fp8": {"enabled": True, "emulate": True}}, "bf16": {"enabled": True}},
     r"with zeroshard.fp8.enabled: fp8 compute swaps whole nn.Linear"),
])
def test_refusals_name_the_key(section, extra, message):
    with pytest.raises(ConfigError, match=message):
        resolve(section, **extra)


def test_mpu_and_tp_group_in_the_json_are_refused():
    with pytest.raises(ConfigError, match=r"tensor_parallel.tp.mpu=\"x\": recognised DeepSpeed key, not supported"):
        resolve({"autotp_size": 2, "tp": {"mpu": "x"}})
