"""A batch triangle computed for 1 process while more run (what the Hugging Face Trainer writes
on a CPU-only machine without use_cpu: docs/hf-trainer.md) names the cause and the fix; DeepSpeed
0.19.8 refuses the same config (checked in /tmp/dsvenv: `4 != 2 * 2 * 2`)."""

import pytest

from zeroshard.config.error import ConfigError
from zeroshard.resolve import resolve_config


def test_a_one_process_triangle_names_use_cpu():
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError, match=r"world_size \(2\) = 8\..*value for 1 process.*use_cpu=True"):
        resolve_config(config, world_size=2)


def test_another_mismatch_has_no_hint():
    config = {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}
    with pytest.raises(ConfigError) as caught:
        resolve_config(config, world_size=2)
    assert "use_cpu" not in str(caught.value)
