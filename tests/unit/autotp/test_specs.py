"""DeepSpeed 0.19.8's AutoTP rule vocabulary (module_inject/autotp_config.py, tp_plan_converter.py)
as zeroshard reads it: the HF plan of transformers 5.23's Llama and Qwen3 becomes DeepSpeed's
layer specs; presets and partition_config dicts give DeepSpeed's rules; first match wins."""

import pytest

from tests.unit.autotp.models import build
from zeroshard.autotp.specs import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    hf_tp_plan,
    merge_autotp_configs,
    specs_from_hf_plan,
)


def test_hf_plan_of_llama_merges_config_class_and_instance_plans():
    plan = hf_tp_plan(build("llama", device="meta"))
    # base_model_tp_plan ("layers.*...") and the class's {"lm_head": ...}; the instance's
    # "model."-prefixed copies of the base entries are the same entries (DeepSpeed's merge).
    assert plan["lm_head"] == "colwise_gather_output"
    assert plan["layers.*.self_attn.o_proj"] == "rowwise"
    assert plan["model.embed_tokens"] == "embedding_rowwise"  # only on the instance
    assert not any(k.startswith("model.layers") for k in plan)


def test_hf_plan_becomes_deepspeed_specs():
    specs = specs_from_hf_plan({"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                                "lm_head": "colwise_gather_output", "embed_tokens": "embedding_rowwise",
                                "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                                "old_head": "colwise_rep"})
    # DeepSpeed's TPPlanConverter: ".*" + escaped glob + "\.weight$"
    assert specs[0].patterns == [r".*layers\..*\.self_attn\.q_proj\.weight$"]
    kinds = [(s.partition_type, s.gather_output, s.grad_allreduce) for s in specs]
    assert kinds == [(PartitionType.COLUMN, False, False), (PartitionType.ROW, False, False),
                     (PartitionType.COLUMN, True, False), (PartitionType.SKIP, False, False),
                     (PartitionType.SKIP, False, True), (PartitionType.COLUMN, True, False)]
    assert specs[0].matches("model.layers.3.self_attn.q_proj.weight")
    assert not specs[0].matches("model.layers.3.self_attn.q_proj.bias")


def test_an_unknown_plan_style_refuses_the_whole_plan():
    with pytest.raises(ValueError, match=r"partition style\(s\) \['sequence_parallel'\].*partition_config"):
        specs_from_hf_plan({"layers.*.q_proj": "colwise", "norm": "sequence_parallel"})


def test_presets_are_deepspeeds():
    assert AutoTPPresets.NAMES == ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")
    llama = AutoTPPresets.get_preset("LLaMA")
    assert [(s.patterns, s.partition_type) for s in llama.layer_specs] == [
        ([r".*\.self_attn\.o_proj\.weight$"], PartitionType.ROW),
        ([r".*\.self_attn\.[qkv]_proj\.weight$"], PartitionType.COLUMN),
        ([r".*\.mlp\.down_proj\.weight$"], PartitionType.ROW),
        ([r".*\.mlp\.(up|gate)_proj\.weight$"], PartitionType.COLUMN),
    ]
    phi3 = AutoTPPresets.get_preset("phi3")
    fused = phi3.find_matching_spec("model.layers.0.self_attn.qkv_proj.weight")
    assert fused.shape == (3, -1) and fused.sub_param_sizes(96) == [32, 32, 32]
    gqa = AutoTPPresets.llama_gqa(num_heads=4, num_kv_heads=2, head_dim=8)
    assert gqa.find_matching_spec("x.self_attn.qkv_proj.weight").sub_param_sizes(64) == [32, 16, 16]
    assert AutoTPPresets.get_preset("gpt9") is None


def test_partition_config_dict_and_merge_with_a_preset():
    custom = AutoTPConfig.from_dict({"layer_specs": [
        {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
         "partition_dim": 0},
        {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "skip"},
    ], "strict_mode": True})
    assert custom.layer_specs[0].shape == (2, -1) and custom.strict_mode
    merged = merge_autotp_configs(AutoTPPresets.llama(), custom)
    # the custom rules come first: o_proj is skipped, not row-split
    assert merged.find_matching_spec("m.layers.0.self_attn.o_proj.weight").partition_type == PartitionType.SKIP
    assert merged.find_matching_spec("m.layers.0.mlp.down_proj.weight").partition_type == PartitionType.ROW


def test_spec_checks():
    with pytest.raises(ValueError, match="'column', 'row' or 'skip'"):
        TPLayerSpec(["x"], "diagonal")
    with pytest.raises(ValueError, match="not a regular expression"):
        TPLayerSpec(["(("])
    with pytest.raises(ValueError, match="only at the partition dimension"):
        TPLayerSpec(["x"], "column", shape=(-1, (4, 4)), partition_dim=0)
    assert TPLayerSpec(["x"], "row").get_partition_dim() == 1
    assert TPLayerSpec(["x"], "column", model_types=["llama"]).matches("x", "qwen2") is False
