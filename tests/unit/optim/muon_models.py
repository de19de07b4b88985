"""Tiny Hugging Face attention models for the per-head Muon tests, built from configs (no hub).

Every family the presets know (zeroshard/optim/muon/heads.py), with grouped-query attention
(fewer key/value heads than query heads) where the family has it, and DeepSeek-V3's MLA with
a q_lora_rank (so q_a_proj / q_b_proj exist). One layer each: the tests need the shapes."""

from __future__ import annotations

import torch

COMMON = {"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 32, "attn_implementation": "eager"}


def tiny(family: str, seed: int = 0) -> torch.nn.Module:
    import transformers as hf

    torch.manual_seed(seed)
    if family == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(**COMMON, intermediate_size=24, head_dim=6))
    if family == "qwen3":
        return hf.Qwen3ForCausalLM(hf.Qwen3Config(**COMMON, intermediate_size=24, head_dim=6))
    if family == "qwen3_moe":
        return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
            **COMMON, intermediate_size=24, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
            head_dim=6))
    if family == "mixtral":
        return hf.MixtralForCausalLM(hf.MixtralConfig(
            **COMMON, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2))
    if family == "deepseek_v3":
        return hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=24, moe_intermediate_size=8,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            n_shared_experts=1, q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
            v_head_dim=6))
    raise ValueError(family)


def tiny_llama() -> torch.nn.Module:
    """For `zeroshard explain --model tests.unit.optim.muon_models:tiny_llama`."""
    return tiny("llama")
