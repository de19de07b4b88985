"""`zeroshard explain` for the expert_parallel section: each routing setting with where it came
from (the config, the model's config, the preset), user values winning over the model's."""

import json

import pytest

from zeroshard.tools.explain import explain_text

pytest.importorskip("transformers")


def _config(tmp_path, **autoep):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"enabled": True, **autoep}}))
    return str(path)


def test_filled_from_the_model_config_and_user_values_win(tmp_path) -> None:
    config = _config(tmp_path, autoep_size=2, route_scale=3.0, top_k=3)
    text = explain_text(config, 4, "tests.unit.moe.autoep_models:tiny_deepseek_v3")
    assert "AutoEP (expert_parallel), autoep_size 2: 2 MoE layer(s) swapped" in text
    lines = {line.strip() for line in text.splitlines()}
    assert "expert_parallel.preset_model = deepseek_v3  (model config model_type='deepseek_v3')" in lines
    assert "expert_parallel.route_scale = 3.0  (config)" in lines  # not the model's 2.446
    assert "expert_parallel.top_k = 3  (config)" in lines
    assert "expert_parallel.num_expert_groups = 4  (model config n_group)" in lines
    assert "expert_parallel.num_limited_groups = 2  (model config topk_group)" in lines
    assert "expert_parallel.route_norm = True  (model config norm_topk_prob)" in lines
    assert "expert_parallel.score_func = sigmoid  (preset deepseek_v3)" in lines
    # the expert stacks are estimated over their expert-data-parallel groups
    flat = " ".join(text.split())
    assert "experts, ep_size 2 (2 layer(s), 4 of 8 experts per rank)" in flat
    assert "expert parameters sharded over [[0, 2], [1, 3]]" in flat


def test_route_scale_from_the_model_when_not_given(tmp_path) -> None:
    text = explain_text(_config(tmp_path), 2, "tests.unit.moe.autoep_models:tiny_deepseek_v3")
    assert "expert_parallel.route_scale = 2.446  (model config routed_scaling_factor)" in text


def test_without_a_model_lists_what_the_config_gives(tmp_path) -> None:
    text = explain_text(_config(tmp_path, autoep_size=2, score_func="sigmoid"), 2)
    assert "expert_parallel.score_func = sigmoid  (config)" in text
    assert "from the model's config at initialize" in text


def test_autoep_size_must_divide_the_experts(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"expert_parallel.autoep_size=3: must divide the number of experts \(8\)"):
        explain_text(_config(tmp_path, autoep_size=3), 3, "tests.unit.moe.autoep_models:tiny_deepseek_v3")
