"""The model presets (zeroshard/models/): Llama 3's published sizes, the Llama against
transformers' own Llama on the same weights, the MoE preset as AutoEP sees it, and the one
table every tool reads."""

from __future__ import annotations

import pytest
import torch

from zeroshard.models import LlamaConfig, batch_for, build_model, preset_info, preset_names
from zeroshard.models.hf import HF_PRESETS, build_hf_model, read_hf_config

# Parameter counts Meta and Hugging Face publish for Llama 3 (and 3.1) 8B and 70B.
PUBLISHED = {"8b": 8_030_261_248, "70b": 70_553_706_496}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama_presets_have_llama3_sizes(name: str) -> None:
    with torch.device("meta"):
        model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]
    assert preset_info(name).family == "llama" and preset_info(name).vocab_size == 128256


def _hf_weights(ours: torch.nn.Module, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Our state dict under transformers' Llama names. Our rotary rotates interleaved pairs
    (Meta's layout); transformers rotates halves, so q and k rows are permuted the way its
    conversion script permutes Meta's checkpoints."""
    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        rows, cols = w.shape
        return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)

    names = {
        "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
        "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    }
    out = {"model.embed_tokens.weight": ours.tok_embeddings.weight, "model.norm.weight": ours.norm.weight,
           "lm_head.weight": ours.output.weight}
    for i, layer in enumerate(ours.layers):
        for key, value in layer.state_dict().items():
            module, _, leaf = key.rpartition(".")
            if module == "attention.wq":
                value = permute(value, config.n_heads)
            elif module == "attention.wk":
                value = permute(value, config.n_kv_heads)
            out[f"model.layers.{i}.{names[module]}.{leaf}"] = value
    return out


def test_llama_equals_transformers_llama() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ours = build_model("llama-tiny")
    config = ours.config
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads,
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_seq_len, tie_word_embeddings=False, attn_implementation="sdpa",
    ))
    theirs.load_state_dict(_hf_weights(ours, config), strict=True)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, loss = ours(tokens, tokens)
    reference = theirs(input_ids=tokens).logits
    # fp32, the same operations in another order (rotary halves vs pairs): rounding only.
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
    assert loss.dtype == torch.float32


def test_moe_preset_is_deepseek_v3_for_autoep() -> None:
    pytest.importorskip("transformers")
    from zeroshard.moe.autoep.presets import preset_for_model_type

    info = preset_info("moonlight-16b-a3b")
    assert (info.family, info.moe) == ("hf", 64)
    assert preset_for_model_type(HF_PRESETS["moonlight-16b-a3b"]["model_type"]) == "deepseek_v3"
    model = build_model("moe-tiny")
    args, kwargs = batch_for(model, torch.randint(0, 256, (2, 8)))
    assert args == () and set(kwargs) == {"input_ids", "labels"}
    assert torch.isfinite(model(**kwargs).loss)


def test_gpt_and_llama_batches_are_positional() -> None:
    for name in ("tiny", "llama-tiny"):
        model = build_model(name)
        tokens = torch.randint(0, 256, (2, 8))
        args, kwargs = batch_for(model, tokens)
        assert kwargs == {} and torch.isfinite(model(*args)[1])


def test_table_and_errors() -> None:
    assert {"tiny", "1b", "8b", "70b", "moonlight-16b-a3b"} <= set(preset_names())
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        build_model("gpt5")
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        build_model("llama-tiny", width=3)
    with pytest.raises(ValueError, match="sequence parallelism is built into the Llama presets"):
        build_model("tiny", sequence_group=object())


def test_hf_config_file(tmp_path) -> None:
    pytest.importorskip("transformers")
    import json

    (tmp_path / "config.json").write_text(json.dumps(HF_PRESETS["moe-tiny"]))
    assert read_hf_config(tmp_path)["model_type"] == "deepseek_v3"  # a folder holding config.json
    assert type(build_hf_model(read_hf_config(tmp_path / "config.json"))).__name__ == "DeepseekV3ForCausalLM"
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ValueError, match="no 'model_type' key"):
        read_hf_config(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="no such file"):
        read_hf_config(tmp_path / "missing.json")
