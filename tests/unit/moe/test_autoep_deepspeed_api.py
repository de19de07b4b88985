"""AutoEP built DeepSpeed's way (its 0.19 names, signatures and module paths), one process:
`AutoEPMoELayer(spec, source_module, ep_size, ep_rank, config)` with `MoELayerSpec` and
`AutoEPConfig`, `TokenChoiceTopKRouter`, `GroupedExperts(dim, hidden_dim, num_experts,
use_grouped_mm)`, `fill_autoep_config_from_hf`, `set_deepspeed_parallelism(
use_data_before_expert_parallel_=...)`. Before: the layer took `(source, settings, ep_size,
ep_rank)` and the other names did not exist.

The assertions are those of DeepSpeed's tests/unit/v1/moe/test_autoep_unit.py (route scale,
counts, shapes, the load-balance refusal, the config fill), and the numbers are checked against
independent references: the unwrapped Hugging Face block, a float64 formula for the router and
the experts, and the layer zeroshard's own swap builds.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

from tests.unit.moe.remote_code_models import remote_deepseek_v3
from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep_config import AutoEPConfig, MoELayerSpec, fill_autoep_config_from_hf
from zeroshard.module_inject.auto_ep_layer import AutoEPMoELayer
from zeroshard.moe.autoep.swap import autoep_layers, replace_moe_layers
from zeroshard.moe.ep_experts import GroupedExperts
from zeroshard.moe.ep_router import TokenChoiceTopKRouter

# float64 on both sides (weights, activations; routing scores in fp32 as both compute them):
# the same routes, expert matmuls differing only in summation order, ~1e-16 relative.
FLOAT64 = {"atol": 1e-12, "rtol": 1e-12}


def mixtral_block(seed: int = 0):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(seed)
    config = MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return block.double()


def spec(**kwargs) -> MoELayerSpec:
    """DeepSpeed's spec of a transformers 5 Mixtral block (fused gate_up_proj)."""
    values = dict(
        moe_module_name="model.layers.0.mlp", model_family="mixtral", router_name="gate", experts_name="experts",
        expert_storage="fused_3d", expert_w1_name="gate_up_proj", expert_w2_name="down_proj", expert_w3_name=None,
        num_experts=4, top_k=2, hidden_size=16, ffn_hidden_size=8, score_func="softmax", score_apply="post",
        route_norm=True, gate_bias=False, return_router_logits=False, router_logits_capture_target="none",
        router_logits_capture_index=None, router_logits_capture_layer_name=None, has_shared_experts=False,
        shared_experts_name="",
    )
    values.update(kwargs)
    return MoELayerSpec(**values)


def config(**kwargs) -> AutoEPConfig:
    kwargs.setdefault("use_grouped_mm", False)
    return AutoEPConfig(enabled=True, autoep_size=1, **kwargs)


def test_layer_built_deepspeeds_way_equals_the_hugging_face_block() -> None:
    block = mixtral_block()
    layer = AutoEPMoELayer(spec(), copy.deepcopy(block), ep_size=1, ep_rank=0, config=config())
    assert layer._is_autoep_layer is True and layer.num_experts == 4 and layer.router.route_scale == 1.0
    assert layer.experts.use_grouped_mm is False
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), block(x), **FLOAT64)


def test_route_scale_scales_the_output_and_grouped_path_agrees() -> None:
    """DeepSpeed's test builds the layer with route_scale=2.5: the routed output is 2.5 times
    the unscaled block's (Mixtral has no shared expert), on the grouped path too."""
    block = mixtral_block(1)
    layer = AutoEPMoELayer(spec(route_scale=2.5), block, 1, 0, config(use_grouped_mm=True))
    assert layer.router.route_scale == pytest.approx(2.5)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    # The scale multiplies the fp32 routing weights (one fp32 rounding, 2^-24 relative) before
    # they weight expert outputs of size ~10: ~1e-6 absolute against scaling the float64 output.
    with torch.no_grad():
        torch.testing.assert_close(layer(x), 2.5 * mixtral_block(1)(x), atol=1e-5, rtol=1e-5)


def test_deepspeed_constructor_equals_zeroshards_swap() -> None:
    """The same block through zeroshard's swap (preset from the model config) and through the
    spec: the same parameters and the same output."""
    model = remote_deepseek_v3().double()
    swapped = copy.deepcopy(model)
    replace_moe_layers(swapped, ExpertParallelConfig(enabled=True), world_size=1)
    ours = autoep_layers(swapped)[0][1]
    c = model.config
    ds_spec = spec(
        model_family="deepseek_v3", expert_storage="module_list", expert_w1_name="gate_proj", expert_w3_name="up_proj",
        num_experts=c.n_routed_experts, hidden_size=c.hidden_size, ffn_hidden_size=c.moe_intermediate_size,
        score_func="sigmoid", route_norm=c.norm_topk_prob,
        has_shared_experts=True, shared_experts_name="shared_experts",
        route_scale=c.routed_scaling_factor, num_expert_groups=c.n_group, num_limited_groups=c.topk_group,
    )
    theirs = AutoEPMoELayer(ds_spec, model.model.layers[1].mlp, 1, 0, config())
    assert theirs.state_dict().keys() == ours.state_dict().keys()
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(theirs.state_dict()[name], value, atol=0, rtol=0, msg=name)
    x = torch.randn(3, 4, c.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ours(x), **FLOAT64)
        torch.testing.assert_close(theirs(x), model.model.layers[1].mlp(x), **FLOAT64)


def test_load_balance_refused_for_a_family_without_expert_bias() -> None:
    with pytest.raises(ValueError, match="load_balance_coeff/expert_bias"):
        AutoEPMoELayer(spec(model_family="no_bias_family", supports_expert_bias=False), mixtral_block(), 1, 0,
                       AutoEPConfig(enabled=True, autoep_size=1, load_balance_coeff=0.02))


@pytest.mark.parametrize(("field", "value", "match"), [
    ("score_apply", "pre", "score_apply"), ("gate_bias", True, "gate_bias"), ("hidden_size", 32, "hidden_size"),
    ("expert_activation", "swiglu_oai", "swiglu_oai"),
])
def test_unsupported_or_wrong_spec_is_refused(field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        AutoEPMoELayer(spec(**{field: value}), mixtral_block(), 1, 0, config())


def test_router_route_scale_groups_and_counts_against_float64() -> None:
    base = TokenChoiceTopKRouter(64, 8, 4, 2, 2, "softmax", False, 1.0, False)
    scaled = TokenChoiceTopKRouter(64, 8, 4, 2, 2, "softmax", False, 2.5, False)
    scaled.load_state_dict(base.state_dict())
    x = torch.randn(50, 64)
    base_scores, base_experts, base_counts = base(x)
    scaled_scores, scaled_experts, scaled_counts = scaled(x)
    assert torch.equal(scaled_experts, base_experts) and torch.equal(scaled_counts, base_counts)
    torch.testing.assert_close(scaled_scores, base_scores * 2.5, atol=1e-5, rtol=0)
    assert base_counts.shape == (8,) and base_counts.dtype == torch.int32 and int(base_counts.sum()) == 100
    # float64: softmax, groups of 2 scored by their two best, 2 of 4 groups kept, top-2 inside.
    probs = F.softmax(x.double() @ base.gate.weight.double().T, dim=-1)
    groups = probs.view(50, 4, 2).sum(-1)
    kept = groups.topk(2, dim=-1).indices
    mask = torch.zeros(50, 4, dtype=torch.bool).scatter_(1, kept, True).repeat_interleave(2, dim=1)
    expected = probs.masked_fill(~mask, -1.0).topk(2, dim=-1).indices
    assert torch.equal(base_experts.sort(-1).values, expected.sort(-1).values)
    torch.testing.assert_close(base_scores.double(), probs.gather(1, base_experts), atol=1e-6, rtol=0)
    assert torch.equal(base_counts, torch.bincount(expected.flatten(), minlength=8).int())


def test_grouped_experts_against_float64_formula() -> None:
    experts = GroupedExperts(dim=64, hidden_dim=128, num_experts=4, use_grouped_mm=False)
    assert experts.w1.shape == (4, 128, 64) and experts.w2.shape == (4, 64, 128) and experts.w1.is_expert_group
    for w in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(w, std=0.02)
    x = torch.randn(8, 64)
    out = experts(x, torch.tensor([2, 2, 2, 2]))
    assert out.shape == (8, 64) and not torch.isnan(out).any()
    rows = []
    for e in range(4):
        t = x[2 * e:2 * e + 2].double()
        h = F.silu(t @ experts.w1[e].double().T) * (t @ experts.w3[e].double().T)
        rows.append(h @ experts.w2[e].double().T)
    torch.testing.assert_close(out.double(), torch.cat(rows), atol=1e-6, rtol=1e-5)


class _DeepSeekV3Config:
    n_group, topk_group, routed_scaling_factor = 4, 2, 2.5


def test_fill_autoep_config_from_hf_defaults_and_explicit_values() -> None:
    filled = AutoEPConfig(enabled=True, autoep_size=2)
    fill_autoep_config_from_hf(filled, _DeepSeekV3Config())
    assert (filled.num_expert_groups, filled.num_limited_groups, filled.route_scale) == (4, 2, 2.5)
    kept = AutoEPConfig(enabled=True, autoep_size=2, num_expert_groups=8, num_limited_groups=1,
                        routed_scaling_factor=3.0, route_scale=3.0)
    fill_autoep_config_from_hf(kept, _DeepSeekV3Config())
    assert (kept.num_expert_groups, kept.num_limited_groups, kept.route_scale) == (8, 1, 3.0)


def test_set_deepspeed_parallelism_signature() -> None:
    layer = AutoEPMoELayer(spec(), mixtral_block(), 1, 0, config())
    assert layer.ep_group is None
    layer.set_deepspeed_parallelism(use_data_before_expert_parallel_=False)
    assert layer.expert_group is not None
    with pytest.raises(ValueError, match="use_data_before_expert_parallel_"):
        layer.set_deepspeed_parallelism(use_data_before_expert_parallel_=True)


def test_signatures_are_deepspeeds() -> None:
    """DeepSpeed 0.19.8's parameter names, in order (read from its source)."""
    def names(fn):
        return list(inspect.signature(fn).parameters)[1:]

    assert names(AutoEPMoELayer.__init__)[:5] == ["spec", "source_module", "ep_size", "ep_rank", "config"]
    assert names(GroupedExperts.__init__)[:5] == [
        "dim", "hidden_dim", "num_experts", "use_grouped_mm", "disable_triton_grouped_mm"]
    assert names(TokenChoiceTopKRouter.__init__) == [
        "dim", "num_experts", "num_expert_groups", "num_limited_groups", "top_k", "score_func", "route_norm",
        "route_scale", "gate_bias", "group_score_func"]
    assert names(AutoEPMoELayer.set_deepspeed_parallelism)[:2] == [
        "use_data_before_expert_parallel_", "folding_group_handles"]
    assert list(inspect.signature(fill_autoep_config_from_hf).parameters) == ["config", "model_config"]
