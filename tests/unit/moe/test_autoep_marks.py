"""AutoEP's swap keeps what the user set on the weights it replaces (one process, autoep_size 1):
`requires_grad` and every attribute (`use_muon`, `is_expert_group`, `ds_*`, names) reach the
router copy and the expert stacks; a stack whose experts disagree on one is refused, naming
the attribute and the experts. The engine-level run (frozen experts stay put through a step
and an export) is tests/dist/moe/test_autoep_frozen.py."""

import types

import pytest
import torch
from torch import nn

from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep import autoep_layers, replace_moe_layers

pytest.importorskip("transformers")


def tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))


def test_frozen_fused_experts_stay_frozen_and_keep_their_attributes() -> None:
    model = tiny_mixtral()
    for name, p in model.named_parameters():
        if ".experts." in name:
            p.requires_grad_(False)
            p.use_muon = False
            p.ds_persist = True
            p.param_name = name
        if name.endswith("mlp.gate.weight"):
            p.is_expert_group = False  # the router keeps its marks too
    replace_moe_layers(model, ExpertParallelConfig(enabled=True), world_size=1)
    layers = autoep_layers(model)
    assert len(layers) == 2
    for name, layer in layers:
        for stack in ("w1", "w2", "w3"):
            p = getattr(layer.experts, stack)
            assert p.requires_grad is False, (name, stack)
            assert p.use_muon is False and p.ds_persist is True, (name, stack)
            source = "gate_up_proj" if stack in ("w1", "w3") else "down_proj"
            assert p.param_name == f"{name}.experts.{source}", (name, stack)
            assert p.allreduce is False and p.group_name == "ep_size_1"  # the stacks' own markers win
        assert layer.router.gate.weight.requires_grad is True
        assert layer.router.gate.weight.is_expert_group is False
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(".experts." in n for n in trainable) and any(".router." in n for n in trainable)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(8, 6, bias=False)
        self.up_proj = nn.Linear(8, 6, bias=False)
        self.down_proj = nn.Linear(6, 8, bias=False)


class _Block(nn.Module):
    """A block with one module per expert (DeepSeek's remote-code layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList([_MLP() for _ in range(4)])


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(n_experts=4, k=2)
        self.moe = _Block()


def _swap(model: nn.Module) -> None:
    cfg = ExpertParallelConfig(
        enabled=True, moe_layer_pattern="moe", router_pattern="gate", expert_pattern="experts",
        expert_w1="gate_proj", expert_w2="down_proj", expert_w3="up_proj", num_experts_attr="n_experts",
        top_k_attr="k")
    replace_moe_layers(model, cfg, world_size=1)


def test_per_expert_modules_carry_their_marks() -> None:
    model = _Model()
    for e in model.moe.experts:
        e.down_proj.weight.requires_grad_(False)  # only the down projections frozen: allowed
        e.gate_proj.weight.use_muon = True
    _swap(model)
    experts = model.moe.experts
    assert experts.w2.requires_grad is False and experts.w1.requires_grad is True
    assert experts.w1.use_muon is True and not hasattr(experts.w3, "use_muon")


@pytest.mark.parametrize("mark", ["requires_grad", "use_muon"])
def test_experts_that_disagree_are_refused_by_name(mark) -> None:
    model = _Model()
    if mark == "requires_grad":
        model.moe.experts[2].up_proj.weight.requires_grad_(False)
    else:
        model.moe.experts[2].up_proj.weight.use_muon = False
    with pytest.raises(ValueError) as info:
        _swap(model)
    text = str(info.value)
    assert f"'{mark}'" in text and "moe.experts.w3" in text
    assert "moe.experts.2.up_proj.weight=False" in text and "moe.experts.0.up_proj.weight=" in text


def test_private_bookkeeping_that_differs_is_left_off() -> None:
    """transformers marks the weights it loaded `_is_hf_initialized`; experts that differ in it
    (some missing from a checkpoint) are no user choice to refuse."""
    model = _Model()
    for e in model.moe.experts:
        for p in e.parameters():
            p._is_hf_initialized = True
    model.moe.experts[1].gate_proj.weight._is_hf_initialized = False
    _swap(model)
    experts = model.moe.experts
    assert not hasattr(experts.w1, "_is_hf_initialized") and experts.w2._is_hf_initialized is True
