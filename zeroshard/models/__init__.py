"""The models zeroshard builds itself, by name: the GPT the demo trains and its size presets,
Llama-3-shaped dense models (`8b`, `70b`) and a DeepSeek-V3/Moonlight-shaped MoE model
(`moonlight-16b-a3b`, a Hugging Face architecture built from its config). `zeroshard explain
--model`, `zeroshard simulate --model` and the benchmarks build them through `build_model`. A
feature floor folder (docs/design.md, "The floors"), so that the tools and the demo both read it."""

from zeroshard.models.gpt import GPT, PRESETS, GPTConfig, build_gpt
from zeroshard.models.llama import LLAMA_PRESETS, Llama, LlamaConfig, build_llama
from zeroshard.models.presets import (
    MODEL_PRESETS,
    PresetInfo,
    batch_for,
    build_model,
    preset_info,
    preset_names,
)

__all__ = [
    "GPT", "GPTConfig", "PRESETS", "build_gpt",
    "LLAMA_PRESETS", "Llama", "LlamaConfig", "build_llama",
    "MODEL_PRESETS", "PresetInfo", "batch_for", "build_model", "preset_info", "preset_names",
]
