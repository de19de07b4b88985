"""Every model zeroshard builds by name, in one table: the demo's GPT sizes, Llama-3-shaped
dense models and a DeepSeek-V3/Moonlight-shaped MoE model.

    from zeroshard.models import build_model, preset_names, preset_info
    with torch.device("meta"):
        model = build_model("70b")            # shapes only: 70.55 B parameters, no memory
    preset_info("moonlight-16b-a3b").family   # "hf": transformers' DeepseekV3ForCausalLM

Every preset's model takes `(idx, targets)` and returns `(logits, loss)` ("gpt", "llama"), or
is a Hugging Face causal LM taking `input_ids=` and `labels=` ("hf"); `batch_for` makes the
matching batch. `zeroshard explain --model`, `zeroshard simulate --model` and the benchmarks
read this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.models.gpt import GPT
from zeroshard.models.gpt import PRESETS as GPT_PRESETS
from zeroshard.models.hf import HF_PRESETS, build_hf_model
from zeroshard.models.llama import LLAMA_PRESETS, Llama

__all__ = ["PresetInfo", "MODEL_PRESETS", "preset_names", "preset_info", "build_model", "batch_for"]


@dataclass(frozen=True)
class PresetInfo:
    """What a preset is.

    Attributes:
        name: the preset's name.
        family: "gpt" (zeroshard.models.gpt), "llama" (zeroshard.models.llama) or "hf" (a
            Hugging Face model built from a config; needs transformers).
        vocab_size / max_seq_len: the token ids it takes and the longest sequence.
        moe: routed experts per MoE layer (0: dense).
    """

    name: str
    family: str
    vocab_size: int
    max_seq_len: int
    moe: int = 0


def _table() -> dict[str, PresetInfo]:
    table: dict[str, PresetInfo] = {}
    for name, gpt in GPT_PRESETS.items():
        table[name] = PresetInfo(name, "gpt", gpt.vocab_size, gpt.block_size, gpt.moe_num_experts)
    for name, llama in LLAMA_PRESETS.items():
        table[name] = PresetInfo(name, "llama", llama.vocab_size, llama.max_seq_len)
    for name, hf in HF_PRESETS.items():
        table[name] = PresetInfo(
            name, "hf", hf["vocab_size"], hf["max_position_embeddings"], hf.get("n_routed_experts", 0)
        )
    return table


MODEL_PRESETS: dict[str, PresetInfo] = _table()


def preset_names() -> list[str]:
    return list(MODEL_PRESETS)


def preset_info(name: str) -> PresetInfo:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}.")
    return MODEL_PRESETS[name]


def build_model(name: str, sequence_group: Any = None, **overrides: Any) -> nn.Module:
    """The preset's model (on torch's default device), with fields of its config overridden
    (GPTConfig, LlamaConfig, or the Hugging Face config's keys). `sequence_group` (Ulysses
    sequence parallelism) is taken by the Llama presets only."""
    import dataclasses

    info = preset_info(name)
    if sequence_group is not None and info.family != "llama":
        raise ValueError(
            f"model preset {name!r}: sequence parallelism is built into the Llama presets "
            f"({', '.join(LLAMA_PRESETS)}) only; a Hugging Face model takes it through --hf-config "
            "(UlyssesSPAttentionHF)."
        )
    if info.family == "gpt":
        return GPT(_replace(GPT_PRESETS[name], overrides, dataclasses))
    if info.family == "llama":
        return Llama(_replace(LLAMA_PRESETS[name], overrides, dataclasses), sequence_group)
    return build_hf_model(HF_PRESETS[name], **overrides)


def _replace(config, overrides: dict, dataclasses) -> Any:
    known = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown {type(config).__name__} field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}."
        )
    return dataclasses.replace(config, **overrides)


def batch_for(model: nn.Module, tokens: torch.Tensor) -> tuple[tuple, dict]:
    """(args, kwargs) to call `model` with on `tokens` [batch, seq] as inputs and next-token
    targets (random ids: the values do not matter to memory or time)."""
    if getattr(model, "config", None) is not None and hasattr(model.config, "model_type"):
        return (), {"input_ids": tokens, "labels": tokens}  # a Hugging Face model shifts the labels itself
    return (tokens, tokens), {}
