"""Every way a Hugging Face MoE model keeps its routing state survives AutoEP's swap and a
checkpoint save/load (one process, autoep_size 1, through `zeroshard.initialize`):

* the selection bias (`e_score_correction_bias`) as a persistent buffer on the gate
  (transformers 5's DeepSeek-V3), as a parameter on the gate (remote-code DeepSeek-V3 /
  Moonlight, tests/unit/moe/remote_code_models.py), as a buffer and as a parameter on the MoE
  block itself (small custom blocks: no transformers 5.23 model keeps it there; DeepSpeed's
  `e_score_correction_bias_path=""`). Before, a parameter became a buffer and a bias on the
  block was lost (the router routed without it).
* packed 3-D expert weights (transformers 5's `gate_up_proj` / `down_proj`) built under
  `zero.Init` at stage 3: the swapped experts hold the values the model was built with
  (DeepSpeed's issue 7848 swapped in the empty partitions).

References: the unswapped model (its loss and its weights, same seed); the checkpoint is
checked against the state at save time after the state was changed on purpose.
Tolerances: loss against the unswapped fp32 model atol 1e-5 (the swap sums the experts in
another order, ~1e-7 relative on an O(1) loss, fp32); values copied or restored: exact.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zeroshard
from tests.unit.moe.remote_code_models import MoEGate, RemoteDeepseekMoE, remote_deepseek_v3
from zeroshard.moe.autoep.export import hf_layouts, to_hf_state_dict
from zeroshard.moe.autoep.swap import autoep_layers

pytest.importorskip("transformers")


def hf_deepseek_v3(seed: int = 0) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=32, hidden_size=16, intermediate_size=12, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, norm_topk_prob=True))
    return model


def _set_bias(model: nn.Module, seed: int) -> None:
    """A bias large enough to change the choice (the model's own init is zero)."""
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and "e_score_correction_bias" in gate._buffers:
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=g) * 0.3)


class BlockBiasGate(MoEGate):
    """The router of a block that keeps the selection bias itself: it reads the block's."""

    def __init__(self, gate: MoEGate, block: nn.Module) -> None:
        nn.Module.__init__(self)
        self.config = gate.config
        self.weight = gate.weight
        self.__dict__["_block"] = block  # not a submodule: the block owns this gate

    @property
    def e_score_correction_bias(self) -> torch.Tensor:
        return self._block.e_score_correction_bias


def block_bias(as_parameter: bool):
    def factory(seed: int = 0) -> nn.Module:
        model = remote_deepseek_v3(seed)
        for layer in model.model.layers:
            block = layer.mlp
            if isinstance(block, RemoteDeepseekMoE):
                bias = block.gate.e_score_correction_bias.detach().clone()
                if as_parameter:
                    block.e_score_correction_bias = nn.Parameter(bias)
                else:
                    block.register_buffer("e_score_correction_bias", bias)
                block.gate = BlockBiasGate(block.gate, block)
        return model
    return factory


def gate_buffer(seed: int = 0) -> nn.Module:
    model = hf_deepseek_v3(seed)
    _set_bias(model, seed)
    return model


# form -> (factory, the bias's name in the unswapped model, kept as a parameter)
FORMS = {
    "gate_buffer": (gate_buffer, "model.layers.1.mlp.gate.e_score_correction_bias", False),
    "gate_parameter": (remote_deepseek_v3, "model.layers.1.mlp.gate.e_score_correction_bias", True),
    "block_buffer": (block_bias(False), "model.layers.1.mlp.e_score_correction_bias", False),
    "block_parameter": (block_bias(True), "model.layers.1.mlp.e_score_correction_bias", True),
}


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "expert_parallel": {"enabled": True, "autoep_size": 1},
    }


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(seed))


def loss_of(model, x: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=x, labels=x)
    return out if torch.is_tensor(out) else out.loss


def owned(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return model.get_submodule(owner), attr


@pytest.mark.parametrize("form", FORMS)
def test_selection_bias_survives_the_swap_and_a_checkpoint(form, tmp_path) -> None:
    factory, name, is_parameter = FORMS[form]
    model = factory()
    reference = copy.deepcopy(model)
    original = reference.get_parameter(name) if is_parameter else reference.get_buffer(name)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config(2),
                                      dist_init_required=False)
    router = dict(autoep_layers(engine.module))["model.layers.1.mlp"].router
    # The swap: same form, same value, the parameter as trainable as it was.
    assert ("e_score_correction_bias" in router._parameters) == is_parameter
    assert ("e_score_correction_bias" in router._buffers) == (not is_parameter)
    torch.testing.assert_close(router.e_score_correction_bias, original, atol=0, rtol=0)
    if is_parameter:
        assert router.e_score_correction_bias.requires_grad == original.requires_grad
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_of(engine, batch(0)), loss_of(reference, batch(0)), atol=1e-5, rtol=0)
        # The bias changes the choice: without it the unswapped model's loss differs.
        unbiased = copy.deepcopy(reference)
        owner, attr = owned(unbiased, name)
        getattr(owner, attr).zero_()
        assert abs(loss_of(unbiased, batch(0)).item() - loss_of(reference, batch(0)).item()) > 1e-6
    # The export names it where the unswapped model has it.
    exported = to_hf_state_dict(engine.module.state_dict(), hf_layouts(engine.module))
    fresh = factory(seed=1)
    fresh.load_state_dict(exported, strict=True)
    torch.testing.assert_close(fresh.state_dict()[name], original, atol=0, rtol=0)

    # The checkpoint: save, change the bias and the weights, load: the saved state is back.
    engine.train()
    engine.backward(loss_of(engine, batch(1)))
    engine.step()
    saved_bias = router.e_score_correction_bias.detach().clone()
    engine.eval()
    with torch.no_grad():
        saved_loss = loss_of(engine, batch(2))
    engine.save_checkpoint(str(tmp_path), tag="t")
    with torch.no_grad():
        router.e_score_correction_bias.copy_(saved_bias.flip(0))
    engine.train()
    engine.backward(loss_of(engine, batch(3)))
    engine.step()
    engine.load_checkpoint(str(tmp_path), tag="t")
    router = dict(autoep_layers(engine.module))["model.layers.1.mlp"].router
    assert ("e_score_correction_bias" in router._parameters) == is_parameter
    torch.testing.assert_close(router.e_score_correction_bias, saved_bias, atol=0, rtol=0)
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_of(engine, batch(2)), saved_loss, atol=1e-6, rtol=0)


def test_load_balancing_holds_a_parameter_bias_as_a_buffer() -> None:
    """The balancer moves the bias at each step; as an optimizer's parameter its master copy
    would undo that, so with load_balance_coeff the bias is a buffer (its value unchanged)."""
    from zeroshard.config.expert_parallel import ExpertParallelConfig
    from zeroshard.moe.autoep.swap import replace_moe_layers

    model = remote_deepseek_v3()
    original = model.get_parameter("model.layers.1.mlp.gate.e_score_correction_bias").detach().clone()
    replace_moe_layers(model, ExpertParallelConfig(enabled=True, load_balance_coeff=1e-3), world_size=1)
    router = dict(autoep_layers(model))["model.layers.1.mlp"].router
    assert "e_score_correction_bias" in router._buffers and "e_score_correction_bias" not in router._parameters
    torch.testing.assert_close(router.e_score_correction_bias, original, atol=0, rtol=0)


def test_packed_experts_built_under_zero_init_keep_their_values(tmp_path) -> None:
    """Stage 3 with the model built under zero.Init (DeepSpeed's idiom): the swapped stacks are
    the model's fused gate_up_proj split in two and its down_proj, not the empty partitions."""
    reference = gate_buffer()
    cfg = config(3)
    with zeroshard.zero.Init(config_dict_or_path=cfg):
        model = gate_buffer()
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                      dist_init_required=False)
    (name, layer), = autoep_layers(engine.module)
    experts = reference.get_submodule(f"{name}.experts")
    ffn = experts.down_proj.shape[-1]
    full = {k: zeroshard.utils.safe_get_full_fp32_param(getattr(layer.experts, k)) for k in ("w1", "w2", "w3")}
    torch.testing.assert_close(full["w1"], experts.gate_up_proj[:, :ffn].detach(), atol=0, rtol=0)
    torch.testing.assert_close(full["w3"], experts.gate_up_proj[:, ffn:].detach(), atol=0, rtol=0)
    torch.testing.assert_close(full["w2"], experts.down_proj.detach(), atol=0, rtol=0)
    torch.testing.assert_close(layer.router.e_score_correction_bias,
                               reference.get_buffer(f"{name}.gate.e_score_correction_bias"), atol=0, rtol=0)
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(loss_of(engine, batch(0)), loss_of(reference, batch(0)), atol=1e-5, rtol=0)
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.train()
    engine.backward(loss_of(engine, batch(1)))
    engine.step()
    moved = zeroshard.utils.safe_get_full_fp32_param(layer.experts.w1)
    assert not torch.equal(moved, full["w1"])
    engine.load_checkpoint(str(tmp_path), tag="t")
    layer = autoep_layers(engine.module)[0][1]
    for key, value in full.items():
        torch.testing.assert_close(zeroshard.utils.safe_get_full_fp32_param(getattr(layer.experts, key)), value,
                                   atol=0, rtol=0, msg=key)
