"""Hugging Face models built from a config alone (no weights, no download): `--hf-config PATH`
and the MoE preset, whose architecture is DeepSeek-V3's as transformers implements it.

transformers is imported when a model is built, not before: zeroshard does not depend on it
(the dev extra installs it). The MoE preset's expert parallelism is AutoEP's: the config's
`expert_parallel` section swaps its MoE blocks at `initialize` (docs/moe.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["HF_PRESETS", "read_hf_config", "build_hf_model"]

# Moonlight-16B-A3B's published config.json (moonshotai/Moonlight-16B-A3B, model_type
# deepseek_v3; the Megatron recipes give the same sizes): 27 layers of width 2048, the first
# dense (ffn 11264), the others 64 routed experts (ffn 1408, 6 per token, sigmoid scores,
# routed_scaling_factor 2.446) and 2 shared experts; multi-head latent attention (16 heads,
# kv_lora_rank 512, no q_lora); vocabulary 163840; untied embeddings. 15.96 B parameters,
# about 3 B active per token. "moe-tiny" has the same structure at test size.
HF_PRESETS: dict[str, dict[str, Any]] = {
    "moonlight-16b-a3b": {
        "model_type": "deepseek_v3", "vocab_size": 163840, "hidden_size": 2048, "intermediate_size": 11264,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},
    },
    "moe-tiny": {
        "model_type": "deepseek_v3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "n_shared_experts": 2, "n_routed_experts": 8, "routed_scaling_factor": 2.446, "kv_lora_rank": 32,
        "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face config.json (or a folder holding one) as a dict; the error names the file
    and what is missing."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--hf-config {path}: no such file. Give a Hugging Face config.json or its folder.") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-config {path}: not JSON ({exc}). Give a Hugging Face config.json.") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(
            f"--hf-config {path}: no 'model_type' key. A Hugging Face config.json names its architecture "
            "there (e.g. \"llama\", \"deepseek_v3\")."
        )
    return data


def build_hf_model(config: dict[str, Any], **overrides: Any):
    """`AutoModelForCausalLM.from_config` on `config` (a config.json's dict) with `overrides`
    applied, freshly initialised (nothing is downloaded). Built where torch's default device
    points, so a caller's `torch.device("meta")` or zero.Init context applies."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "building a Hugging Face model needs the transformers package: pip install transformers"
        ) from None
    data = {**config, **overrides}
    model_type = data.pop("model_type")
    data.pop("architectures", None)
    data.pop("transformers_version", None)
    try:
        hf_config = transformers.AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"model_type {model_type!r}: {exc}") from None
    return transformers.AutoModelForCausalLM.from_config(hf_config)
