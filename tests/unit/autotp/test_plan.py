"""plan_tensor_parallel against tiny Hugging Face models: what each Linear becomes under the
model's own plan, a preset and a partition_config, and every refusal, by layer name."""

import types

import pytest
import torch
from torch import nn

from tests.unit.autotp.models import build
from zeroshard.autotp.plan import TensorParallelPlanError, plan_tensor_parallel


def settings(**kw):
    base = {"preset_model": None, "partition_config": None, "vocab_parallel_lm_head": None}
    return types.SimpleNamespace(**{**base, **kw})


def kinds(plan):
    return {p.name: p.kind + ("+gather" if p.gather_output else "") for p in plan.placements}


def test_llama_by_its_tp_plan():
    plan = plan_tensor_parallel(build("llama", device="meta"), settings(), 2)
    assert plan.source == "tp_plan"
    got = kinds(plan)
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        assert [got[prefix + n] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] == [
            "column", "column", "column", "row", "column", "column", "row"]
    assert got["lm_head"] == "column+gather"
    assert plan.grad_sum == []


def test_qwen3_sums_q_norm_and_k_norm_gradients():
    plan = plan_tensor_parallel(build("qwen3", device="meta"), settings(), 2)
    assert plan.grad_sum == [f"model.layers.{i}.self_attn.{n}.weight" for i in range(2) for n in ("q_norm", "k_norm")]


def test_gqa_refuses_more_ranks_than_key_value_heads():
    with pytest.raises(TensorParallelPlanError, match=r"autotp_size=4: above the model's 2 key-value heads"):
        plan_tensor_parallel(build("llama", device="meta"), settings(), 4)
    with pytest.raises(TensorParallelPlanError, match=r"does not divide the model's 3 key-value heads"):
        model = build("llama", device="meta", hidden_size=48, num_attention_heads=6, num_key_value_heads=3)
        plan_tensor_parallel(model, settings(), 2)


def test_uneven_mlp_at_four_is_refused_naming_each_layer():
    model = build("llama", device="meta", num_attention_heads=4, num_key_value_heads=4, intermediate_size=66)
    with pytest.raises(TensorParallelPlanError) as error:
        plan_tensor_parallel(model, settings(), 4)
    problems = error.value.problems
    assert "model.layers.0.mlp.gate_proj: out_features 66 not divisible by tensor_parallel.autotp_size=4" in problems[0]
    assert any("model.layers.1.mlp.down_proj: in_features 66" in p for p in problems)


def test_a_model_without_rules_is_refused():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(TensorParallelPlanError, match="Sequential has no tensor-parallel plan.*preset_model"):
        plan_tensor_parallel(model, settings(), 2)


def test_partition_config_rules():
    model = nn.Sequential()
    model.add_module("embed", nn.Embedding(10, 8))
    model.add_module("up", nn.Linear(8, 16))
    model.add_module("down", nn.Linear(16, 8))
    model.add_module("extra", nn.Linear(8, 8))
    rules = {"layer_specs": [{"patterns": [r"up\.weight$"], "partition_type": "column"},
                             {"patterns": [r"down\.weight$"], "partition_type": "row"}]}
    plan = plan_tensor_parallel(model, settings(partition_config=rules), 2)
    assert kinds(plan) == {"up": "column", "down": "row", "extra": "whole"}  # unmatched: kept whole (DeepSpeed's)
    with pytest.raises(TensorParallelPlanError, match=r"extra: no rule .*strict_mode"):
        plan_tensor_parallel(model, settings(partition_config={**rules, "strict_mode": True}), 2)
    bad = {"layer_specs": [*rules["layer_specs"], {"patterns": [r"embed\.weight$"], "partition_type": "column"}]}
    with pytest.raises(TensorParallelPlanError, match=r"embed: rule .* splits an embedding"):
        plan_tensor_parallel(model, settings(partition_config=bad), 2)


def test_fused_qkv_with_unequal_sub_parameters():
    model = nn.Module()
    model.self_attn = nn.Module()
    model.self_attn.qkv_proj = nn.Linear(8, 16 + 8 + 8, bias=False)
    model.self_attn.o_proj = nn.Linear(16, 8, bias=False)
    rules = {"layer_specs": [
        {"patterns": [r".*qkv_proj\.weight$"], "partition_type": "column", "shape": [[16, 8, 8], -1],
         "partition_dim": 0},
        {"patterns": [r".*o_proj\.weight$"], "partition_type": "row"}]}
    plan = plan_tensor_parallel(model, settings(partition_config=rules), 2)
    assert plan.by_name()["self_attn.qkv_proj"].sub_sizes == (16, 8, 8)
    with pytest.raises(TensorParallelPlanError, match=r"sub-parameters \[16, 8, 8\]\) not divisible"):
        plan_tensor_parallel(model, settings(partition_config=rules), 16)


def test_a_tied_head_stays_whole_with_a_warning():
    model = build("llama", device="meta", tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="lm_head shares its weight with model.embed_tokens: both stay whole"):
        plan = plan_tensor_parallel(model, settings(), 2)
    assert kinds(plan)["lm_head"] == "whole"


def test_a_head_without_gathered_logits_is_refused():
    model = build("llama", device="meta")
    rules = {"layer_specs": [{"patterns": [r"lm_head\.weight$"], "partition_type": "column"}]}
    with pytest.raises(TensorParallelPlanError, match=r"lm_head: a column-split output head without gather_output"):
        plan_tensor_parallel(model, settings(partition_config=rules, preset_model="llama"), 2)


def test_plan_reads_no_parameter_values():
    model = build("llama", device="meta")
    assert all(p.device == torch.device("meta") for p in model.parameters())
    plan_tensor_parallel(model, settings(), 2)
