"""Sizes of rank groups the config asks for are checked against the world size in the one
resolve pass, so `zeroshard explain --world-size N` refuses what `initialize` on N ranks
refuses, with the same message naming the key the user wrote (not the internal `ep_size`)."""

import json

import pytest

from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config
from zeroshard.tools.explain import explain_data

BASE = {"train_micro_batch_size_per_gpu": 1}
AUTOEP_4 = "expert_parallel.autoep_size=4: must divide the world size 2"
SHARD_4 = "zeroshard.shard_group_size=4: must divide the world size 2"


def _write(tmp_path, config) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"expert_parallel": {"enabled": True, "autoep_size": 4}}, AUTOEP_4),
        ({"zeroshard": {"shard_group_size": 4}}, SHARD_4),
    ],
)
def test_explain_and_resolve_refuse_with_the_users_key(tmp_path, extra, expected) -> None:
    config = {**BASE, **extra}
    with pytest.raises(ConfigError) as from_resolve:  # what initialize runs on 2 ranks
        resolve_config(config, world_size=2)
    with pytest.raises(ConfigError) as from_explain:
        explain_data(_write(tmp_path, config), 2)
    assert str(from_resolve.value).startswith(expected), str(from_resolve.value)
    assert str(from_explain.value) == str(from_resolve.value)
    assert "ep_size=" not in str(from_resolve.value).replace("autoep_size=", "")


def test_both_sizes_reported_at_once() -> None:
    config = {**BASE, "expert_parallel": {"enabled": True, "autoep_size": 4}, "zeroshard": {"shard_group_size": 4}}
    with pytest.raises(ConfigError) as info:
        resolve_config(config, world_size=2)
    assert [p.split(":")[0] for p in info.value.problems] == [
        "expert_parallel.autoep_size=4", "zeroshard.shard_group_size=4"]


@pytest.mark.parametrize("world", [4, 8])
def test_divisors_are_accepted(world) -> None:
    config = {**BASE, "expert_parallel": {"enabled": True, "autoep_size": 4}, "zeroshard": {"shard_group_size": 4}}
    cfg = resolve_config(config, world_size=world)
    assert cfg.expert_parallel.autoep_size == 4 and cfg.zeroshard.shard_group_size == 4


def test_disabled_expert_parallel_is_not_checked() -> None:
    # initialize swaps nothing then (DeepSpeed ignores the section's sizes too)
    resolve_config({**BASE, "expert_parallel": {"enabled": False, "autoep_size": 4}}, world_size=2)


def test_the_swap_itself_names_the_key() -> None:
    """replace_moe_layers, called directly (without resolve), says autoep_size too."""
    pytest.importorskip("transformers")
    from tests.unit.moe.autoep_models import tiny_deepseek_v3
    from zeroshard.module_inject.auto_ep import replace_moe_layers

    with pytest.raises(ValueError, match=r"^expert_parallel\.autoep_size=4: must divide the world size 2 "):
        replace_moe_layers(tiny_deepseek_v3(), ExpertParallelConfig(enabled=True, autoep_size=4), world_size=2)


def test_explain_with_a_model_checks_the_expert_count(tmp_path) -> None:
    """autoep_size 16 divides a world of 16 but not the model's 8 experts: refused, by key."""
    pytest.importorskip("transformers")
    config = _write(tmp_path, {**BASE, "expert_parallel": {"enabled": True, "autoep_size": 16}})
    with pytest.raises(ValueError, match=r"expert_parallel\.autoep_size=16: must divide the number of experts \(8\)"):
        explain_data(config, 16, "tests.unit.moe.autoep_models:tiny_deepseek_v3")
