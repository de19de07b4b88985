"""DeepSpeed's AutoEP kernel keys (use_grouped_mm, disable_triton_grouped_mm, combine_impl) reach
the swapped layer and pick its path; every choice computes what the Hugging Face block does.

Reference: the unswapped Mixtral block in float64, forward and the input's gradient. Tolerance
absolute, a fraction of each tensor's largest value: 1e-13 (the paths add the same products in
another order: a few float64 ulps); the legacy_bmm combine multiplies in fp32 (DeepSpeed's), so
1e-6 for it (fp32 rounding of inputs and result, ~6e-8 each, over k=2 terms and the backward)."""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
from torch import nn

from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep import replace_moe_layers
from zeroshard.resolve import resolve_config

pytest.importorskip("transformers")


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf = MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=8, num_experts_per_tok=2)
        self.config = types.SimpleNamespace(n_experts=8, k=2)
        self.moe = MixtralSparseMoeBlock(hf)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.moe(h)


def _swapped(model: nn.Module, **knobs):
    cfg = ExpertParallelConfig(enabled=True, moe_layer_pattern="moe", router_pattern="gate", expert_pattern="experts",
                               num_experts_attr="n_experts", top_k_attr="k", **knobs)
    swapped = copy.deepcopy(model)
    replace_moe_layers(swapped, cfg, world_size=1)
    return swapped


def _value_and_grad(model: nn.Module, h: torch.Tensor):
    h = h.clone().requires_grad_()
    out = model(h)
    out.backward(torch.cos(out.detach()))  # a non-uniform upstream gradient
    return out.detach(), h.grad


@pytest.mark.parametrize(
    ("knobs", "path", "combine", "tol"),
    [
        ({}, {"bmm", "loop"}, "weighted_sum", 1e-13),
        ({"use_grouped_mm": False}, {"loop"}, "weighted_sum", 1e-13),
        ({"use_grouped_mm": False, "disable_triton_grouped_mm": True}, {"loop"}, "weighted_sum", 1e-13),
        ({"combine_impl": "weighted_sum"}, {"bmm", "loop"}, "weighted_sum", 1e-13),
        ({"combine_impl": "legacy_bmm"}, {"bmm", "loop"}, "legacy_bmm", 1e-6),
    ],
)
def test_knobs_pick_the_path_and_keep_the_result(knobs, path, combine, tol) -> None:
    torch.manual_seed(0)
    model = Blocks().double().eval()
    h = torch.randn(3, 20, 16, dtype=torch.float64)
    expected, expected_grad = _value_and_grad(model, h)
    swapped = _swapped(model, **knobs)
    got, grad = _value_and_grad(swapped, h)
    layer = swapped.moe
    assert layer.experts.last_path in path and layer.combine_impl == combine
    torch.testing.assert_close(got, expected, atol=tol * expected.abs().max().item(), rtol=0)
    torch.testing.assert_close(grad, expected_grad, atol=tol * expected_grad.abs().max().item(), rtol=0)


def test_even_routing_takes_bmm_by_default() -> None:
    """The swapped layer's default knobs take bmm for evenly loaded experts (CPU, float64)."""
    from zeroshard.moe.autoep.expert_paths import choose_path

    torch.manual_seed(0)
    swapped = _swapped(Blocks().double())
    experts = swapped.moe.experts
    x = torch.zeros(1, 16, dtype=torch.float64)
    assert choose_path(x, [15] * 8, experts.w1, experts.use_grouped_mm, experts.force_native_grouped_mm) == "bmm"


def test_knobs_are_not_reported_as_no_effect() -> None:
    raw = {"expert_parallel": {"enabled": True, "use_grouped_mm": False, "disable_triton_grouped_mm": True,
                               "combine_impl": "legacy_bmm"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "changes nothing here" warning would be wrong now
        cfg = resolve_config(raw)
    assert cfg.no_effect_keys == []
    ep = cfg.expert_parallel
    assert (ep.use_grouped_mm, ep.disable_triton_grouped_mm, ep.combine_impl) == (False, True, "legacy_bmm")


def test_unknown_combine_impl_is_refused() -> None:
    with pytest.raises(ValueError, match="combine_impl"):
        resolve_config({"expert_parallel": {"enabled": True, "combine_impl": "fused"}})
