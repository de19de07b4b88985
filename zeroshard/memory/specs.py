"""The models the prediction can build on fake tensors: zeroshard.models' presets, a Hugging Face
config, or `module:factory` (parameters only: its inputs are unknown)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroshard.memory.trace import ModelSpec

__all__ = ["factory_spec", "hf_config_spec", "preset_spec"]


def preset_spec(name: str) -> ModelSpec:
    """One of zeroshard.models' presets (the GPT sizes, the Llama-3 shapes, the MoE presets built
    from Hugging Face configs); a micro-batch is the preset's own (token ids and next-token
    targets, or `input_ids` with `labels`) and the loss is the model's own."""
    from zeroshard.models import batch_for, build_model, preset_info, preset_names

    if name not in preset_names():
        raise ValueError(f"--model {name}: unknown preset; use one of {', '.join(preset_names())}, or module:factory.")
    info = preset_info(name)

    def inputs(model: nn.Module, micro_batch: int, seq: int) -> tuple[tuple, dict]:
        ids = torch.randint(0, info.vocab_size, (micro_batch, seq))
        args, kwargs = batch_for(model, ids)
        if args:  # (inputs, targets): the targets are a tensor of their own, as a data loader's are
            args = (ids, torch.randint(0, info.vocab_size, (micro_batch, seq)))
        return args, kwargs

    return ModelSpec(name, lambda: build_model(name), inputs, max_seq=info.max_seq_len)


def hf_config_spec(path: str | Path) -> ModelSpec:
    """A Hugging Face causal LM built from its config (a config.json or the folder holding it),
    without weights; a micro-batch is `input_ids` with `labels`, the loss the model's own."""
    import transformers

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-config {path}: cannot read a JSON config ({exc}).") from None
    config = transformers.AutoConfig.for_model(**raw) if "model_type" in raw else None
    if config is None:
        raise ValueError(f"--hf-config {path}: no \"model_type\" in it; give a Hugging Face config.json.")
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    max_seq = getattr(config, "max_position_embeddings", None)

    def build() -> nn.Module:
        return transformers.AutoModelForCausalLM.from_config(config)

    def inputs(model: nn.Module, micro_batch: int, seq: int) -> tuple[tuple, dict]:
        ids = torch.randint(0, max(vocab, 1), (micro_batch, seq))
        return (), {"input_ids": ids, "labels": ids}

    return ModelSpec(f"{getattr(config, 'model_type', 'hf')} ({file})", build, inputs, max_seq=max_seq)


def factory_spec(spec: str) -> ModelSpec:
    """`module:factory`, where `factory()` returns an nn.Module. Its inputs are unknown, so the
    prediction counts its states and buffers but traces no forward."""
    module_name, _, attr = spec.partition(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does, so a module in the working directory imports
    try:
        factory: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model {spec}: cannot import {attr!r} from {module_name!r} ({exc}).") from None
    return ModelSpec(spec, factory)
