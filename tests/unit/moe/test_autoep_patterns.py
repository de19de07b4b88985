"""AutoEP on a model without a preset: the pattern keys name the MoE blocks, their router and
experts children; the model config's attributes give the expert count and top-k. One process
(autoep_size 1): the swapped block computes what the Hugging Face block computes."""

import re
import types

import pytest
import torch
from torch import nn

from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep import replace_moe_layers
from zeroshard.module_inject.auto_ep_layer import AutoEPMoELayer

pytest.importorskip("transformers")


class Custom(nn.Module):
    """Two Mixtral sparse blocks under names no preset knows."""

    def __init__(self, jitter: float = 0.0) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf = MixtralConfig(hidden_size=16, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=jitter)
        self.config = types.SimpleNamespace(n_experts=4, k=2)  # no model_type: no preset
        self.blocks = nn.ModuleList([nn.ModuleDict({"moe": MixtralSparseMoeBlock(hf)}) for _ in range(2)])
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = h + block["moe"](h.clone())  # Mixtral's jitter scales its input in place
        return h


@pytest.mark.parametrize("jitter", [0.0, 0.1])
def test_pattern_keys_swap_a_model_without_preset(jitter) -> None:
    torch.manual_seed(0)
    model = Custom(jitter)  # training mode: Mixtral's router jitter draws from torch's RNG
    h = torch.randn(2, 5, 16)
    torch.manual_seed(1)
    expected = model(h)
    cfg = ExpertParallelConfig(enabled=True, moe_layer_pattern=r"blocks\.\d+\.moe", router_pattern="gate",
                               expert_pattern="experts", num_experts_attr="n_experts", top_k_attr="k")
    settings, names = replace_moe_layers(model, cfg, world_size=1)
    assert names == ["blocks.0.moe", "blocks.1.moe"]
    assert isinstance(model.blocks[0]["moe"], AutoEPMoELayer)
    assert settings.sources["num_experts"] == "model config n_experts" and settings.top_k == 2
    # fp32: the same products, gate and up as two matmuls instead of one fused, routes summed in
    # another order: differences of a few ulps of the largest value (cancellation makes the
    # relative error of a small element large, so the bound is absolute, on the output's scale)
    torch.manual_seed(1)
    torch.testing.assert_close(model(h), expected, atol=1e-6 * expected.abs().max().item(), rtol=0)


def test_no_matching_block_names_the_key() -> None:
    cfg = ExpertParallelConfig(enabled=True, moe_layer_pattern=r"layers\.\d+\.ffn", num_experts_attr="n_experts",
                               top_k_attr="k")
    message = 'expert_parallel.moe_layer_pattern="layers\\.\\d+\\.ffn": no module'
    with pytest.raises(ValueError, match=re.escape(message)):
        replace_moe_layers(Custom(), cfg, world_size=1)


def test_no_preset_and_no_pattern_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expert_parallel.preset_model=null: no preset for model_type=None"):
        replace_moe_layers(Custom(), ExpertParallelConfig(enabled=True), world_size=1)
