"""`"zeroshard": {"deterministic_reduction": true}`: the configs where the same bits at every
world size cannot hold are refused by the resolve pass (so by `initialize` and `explain` alike),
each with its reason and its fix (zeroshard/config/deterministic.py); the others resolve."""

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def _config(**extra):
    config = {"train_micro_batch_size_per_gpu": 2, "zeroshard": {"deterministic_reduction": True}}
    for key, value in extra.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


@pytest.mark.parametrize("world_size, steps", [(1, 8), (2, 4), (4, 2), (8, 1), (8, 3), (16, 5), (3, 1), (6, 1)])
def test_power_of_two_ranks_or_no_accumulation_resolve(world_size, steps):
    cfg = resolve_config(_config(gradient_accumulation_steps=steps), world_size)
    assert cfg.zeroshard.deterministic_reduction
    assert cfg.train_batch_size == 2 * steps * world_size


@pytest.mark.parametrize("world_size", [3, 6, 12])
def test_other_rank_counts_with_accumulation_are_refused(world_size):
    with pytest.raises(ConfigError, match=(
        rf"zeroshard\.deterministic_reduction=true: data-parallel size {world_size} with "
        r"gradient_accumulation_steps=2: .*power-of-two number of ranks\. Use 1, 2, 4, 8, \.\.\. ranks, or "
        r"gradient_accumulation_steps 1")):
        resolve_config(_config(gradient_accumulation_steps=2), world_size)


@pytest.mark.parametrize("extra, world_size, message", [
    ({"sequence_parallel_size": 2}, 4, r"sequence_parallel_size=2 splits every micro-batch over 2 ranks.*"
     r"Set sequence_parallel_size to 1"),
    ({"managed_gradient_accumulation": False}, 2, r"managed_gradient_accumulation=false lets step\(\) end an "
     r"accumulation anywhere.*Set managed_gradient_accumulation to true"),
    ({"zeroshard": {"shard_group_size": 2}}, 4, r"zeroshard\.shard_group_size=2 replicates shards over 2 groups.*"
     r"Leave shard_group_size unset"),
    ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, 2, r"expert_parallel\.autoep_size=2: an expert "
     r"computes on the tokens of 2 ranks' micro-batches.*Set autoep_size to 1"),
    ({"tensor_parallel": {"autotp_size": 2}}, 4, r"tensor_parallel\.autotp_size=2 splits every micro-batch's "
     r"matmuls over 2 ranks.*Set autotp_size to 1"),
])
def test_what_splits_a_micro_batch_or_a_reduction_is_refused(extra, world_size, message):
    with pytest.raises(ConfigError, match=r"zeroshard\.deterministic_reduction=true: " + message):
        resolve_config(_config(**extra), world_size)


def test_every_problem_is_reported_together():
    with pytest.raises(ConfigError) as info:
        resolve_config(_config(gradient_accumulation_steps=2, managed_gradient_accumulation=False,
                               zeroshard={"shard_group_size": 3}), 6)
    text = str(info.value)
    for needle in ("data-parallel size 6", "managed_gradient_accumulation=false", "shard_group_size=3"):
        assert needle in text


def test_off_by_default_and_nothing_is_refused_then():
    cfg = resolve_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 3)
    assert not cfg.zeroshard.deterministic_reduction
    assert resolve_config(_config(zeroshard={"deterministic_reduction": False}, gradient_accumulation_steps=2), 3)
