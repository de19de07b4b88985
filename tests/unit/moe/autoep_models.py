"""Model factories for `zeroshard explain --model` tests of AutoEP (built on the meta device)."""


def tiny_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=48, hidden_size=16, intermediate_size=12, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.446, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, norm_topk_prob=True))
