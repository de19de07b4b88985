"""AutoEP on experts held as one module per expert (remote-code DeepSeek-V3 / Moonlight,
transformers 4's Mixtral), in one process (autoep_size 1):

* with default keys the swap detects the layout (before: a bare `AttributeError: 'MLP' object
  has no attribute 'gate_up_proj'`), and the swapped model computes what the unswapped one
  does (its forward, tests/unit/moe/remote_code_models.py, loops over tokens and experts);
* the export gives the model's own names and shapes back: the unswapped model strict-loads it
  and holds exactly its original values (before: stacked `experts.gate_proj` tensors it could
  not load);
* names that fit no layout are refused with a message naming the keys.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.moe.remote_code_models import modulelist_mixtral, remote_deepseek_v3, stacked_deepseek_v3
from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.moe.autoep.export import hf_layouts, to_hf_state_dict
from zeroshard.moe.autoep.swap import autoep_layers, replace_moe_layers

FACTORIES = {
    "remote_deepseek_v3": remote_deepseek_v3, "modulelist_mixtral": modulelist_mixtral,
    "stacked_deepseek_v3": stacked_deepseek_v3,
}
# The names and whether the experts are one module each, as detected.
LAYOUTS = {
    "remote_deepseek_v3": ("gate_proj", "down_proj", "up_proj", True),
    "modulelist_mixtral": ("w1", "w2", "w3", True),
    "stacked_deepseek_v3": ("gate_proj", "down_proj", "up_proj", False),
}
# float64 weights and activations on both sides, routing in fp32 on both (as the models do it):
# the same routing weights, and expert matmuls that differ only in float64 rounding (stacked
# slices against Linear modules, another summation order), ~1e-16 relative on O(1) logits.
FLOAT64 = {"atol": 1e-12, "rtol": 1e-12}


def swapped_copy(model, **keys):
    swapped = copy.deepcopy(model)
    replace_moe_layers(swapped, ExpertParallelConfig(enabled=True, **keys), world_size=1)
    return swapped


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32, (3, 7), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", FACTORIES)
def test_default_keys_detect_the_layout_and_the_forward_is_unchanged(kind) -> None:
    model = FACTORIES[kind]().double()
    swapped = swapped_copy(model)
    layers = autoep_layers(swapped)
    assert [name for name, _ in layers] == [n for n, m in model.named_modules() if n.endswith(".mlp")
                                             and hasattr(m, "experts")]
    preset = layers[0][1].settings.preset
    assert (preset.expert_w1, preset.expert_w2, preset.expert_w3, preset.expert_modules) == LAYOUTS[kind]
    with torch.no_grad():
        for seed in range(3):
            torch.testing.assert_close(swapped(tokens(seed)), model(tokens(seed)), **FLOAT64)


def test_remote_deepseek_v3_selection_bias_parameter_is_used() -> None:
    """The gate's e_score_correction_bias (an nn.Parameter in remote code) reaches the router,
    and it changes choices: zeroing it in both models changes the output, equally."""
    model = remote_deepseek_v3().double()
    swapped = swapped_copy(model)
    router = autoep_layers(swapped)[0][1].router
    torch.testing.assert_close(router.e_score_correction_bias, model.model.layers[1].mlp.gate.e_score_correction_bias,
                               atol=0, rtol=0)
    with torch.no_grad():
        before = model(tokens())
        model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
        router.e_score_correction_bias.zero_()
        after = model(tokens())
        torch.testing.assert_close(swapped(tokens()), after, **FLOAT64)
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("kind", FACTORIES)
def test_export_strict_loads_into_the_unswapped_model_with_equal_values(kind) -> None:
    model = FACTORIES[kind]()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = swapped_copy(model)
    exported = to_hf_state_dict(swapped.state_dict(), hf_layouts(swapped))
    assert set(exported) == set(original)
    for name, value in original.items():
        assert exported[name].shape == value.shape, name
        torch.testing.assert_close(exported[name], value, atol=0, rtol=0, msg=name)
    fresh = FACTORIES[kind](seed=1)
    fresh.load_state_dict(exported, strict=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, original[name], atol=0, rtol=0, msg=name)


def test_export_rows_do_not_share_storage() -> None:
    """safetensors refuses tensors that share storage: each expert's row is its own copy."""
    swapped = swapped_copy(remote_deepseek_v3())
    exported = to_hf_state_dict(swapped.state_dict(), hf_layouts(swapped))
    expert_rows = [v for k, v in exported.items() if ".experts." in k]
    assert len({v.untyped_storage().data_ptr() for v in expert_rows}) == len(expert_rows) == 2 * 8 * 3


def test_layout_recorded_for_checkpoints_is_json() -> None:
    import json

    layouts = hf_layouts(swapped_copy(remote_deepseek_v3()))
    assert json.loads(json.dumps(layouts))["model.layers.1.mlp"] == {
        "router": "gate", "experts": "experts", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj",
        "bias": "e_score_correction_bias", "modules": True, "weight_attr": "weight",
    }


def test_stacked_layout_keeps_the_preset_names() -> None:
    """transformers 5's fused layout (stacked gate_up_proj) is still the preset's."""
    pytest.importorskip("transformers")
    from tests.unit.moe.autoep_models import tiny_deepseek_v3

    swapped = tiny_deepseek_v3()
    replace_moe_layers(swapped, ExpertParallelConfig(enabled=True), world_size=1)
    preset = autoep_layers(swapped)[0][1].settings.preset
    assert (preset.expert_w1, preset.expert_w3, preset.expert_modules) == ("gate_up_proj", None, False)


def test_written_names_that_do_not_fit_are_refused_naming_the_keys() -> None:
    message = (r"expert_parallel\.expert_w1='gate_up_proj': model\.layers\.1\.mlp\.experts\.0 \(MLP, one module per "
               r"expert\) has no weights named gate_up_proj/down_proj.*it has gate_proj, up_proj, down_proj, act_fn")
    with pytest.raises(ValueError, match=message):
        swapped_copy(remote_deepseek_v3(), expert_w1="gate_up_proj")


def test_written_names_that_fit_are_kept() -> None:
    model = remote_deepseek_v3().double()
    swapped = swapped_copy(model, expert_w1="gate_proj", expert_w2="down_proj", expert_w3="up_proj")
    with torch.no_grad():
        torch.testing.assert_close(swapped(tokens()), model(tokens()), **FLOAT64)


def test_unknown_per_expert_names_are_refused() -> None:
    model = remote_deepseek_v3()
    for layer in model.model.layers[1:]:
        for expert in layer.mlp.experts:
            expert.fc_in = expert.gate_proj
            del expert.gate_proj
    with pytest.raises(ValueError, match=r"expert_parallel\.expert_w1/expert_w2/expert_w3: .*known layout "
                                         r"\(gate_proj/down_proj/up_proj, w1/w2/w3\).*Set expert_w1 \(gate\)"):
        swapped_copy(model)


def test_expert_count_must_match_the_config() -> None:
    model = remote_deepseek_v3()
    model.config.n_routed_experts = 4
    model.config.n_group = 2
    with pytest.raises(ValueError, match=r"num_experts_attr='n_routed_experts': the model config says 4 experts, "
                                         r"but model\.layers\.1\.mlp\.experts holds 8 modules"):
        swapped_copy(model)
