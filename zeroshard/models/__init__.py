"""The models zeroshard builds itself: the GPT the demo trains and its size presets, which
`zeroshard explain --model` and the benchmarks build by name. A feature floor folder
(docs/design.md, "The floors"), so that the tools and the demo both read it."""

from zeroshard.models.gpt import GPT, PRESETS, GPTConfig, build_gpt

__all__ = ["GPT", "GPTConfig", "PRESETS", "build_gpt"]
