"""Tiny Hugging Face models built from configs (no hub): Llama with grouped-query attention
(4 query heads, 2 key-value heads) and Qwen3 (q_norm/k_norm, replicated_with_grad_allreduce)."""

from __future__ import annotations

import torch


def llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    return LlamaConfig(**kw)


def qwen3_config(**overrides):
    from transformers import Qwen3Config

    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    kw.update(overrides)
    return Qwen3Config(**kw)


def build(kind: str, seed: int = 0, device: str | None = None, **overrides):
    """A tiny causal LM, the same weights for the same seed."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cls, config = (LlamaForCausalLM, llama_config) if kind == "llama" else (Qwen3ForCausalLM, qwen3_config)
    if device is None:
        return cls(config(**overrides))
    with torch.device(device):
        return cls(config(**overrides))
