"""Rank-side helpers for the Hugging Face integration tests (tests/dist/hf/).

transformers and accelerate decide once, when first imported, whether DeepSpeed is installed
(`importlib.util.find_spec("deepspeed")` and its distribution metadata). So every task here runs
in a pool of its own (tests/dist/hf/alias_pool.py) and calls `use_alias` before anything
imports transformers: the `deepspeed` alias directory goes on `sys.path` first.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

import torch

VOCAB = 128


def use_alias(alias_dir: str) -> None:
    """Put the `deepspeed` alias (zeroshard) on this process's path; refuse a process where
    transformers or accelerate were already imported without it."""
    if alias_dir not in sys.path:
        early = [m for m in ("transformers", "accelerate", "trl") if m in sys.modules]
        if early:
            raise RuntimeError(f"{early} imported before the deepspeed alias: run this task in a fresh pool.")
        sys.path.insert(0, alias_dir)
        importlib.invalidate_caches()
    import deepspeed

    import zeroshard

    if deepspeed is not zeroshard or "+zeroshard" not in importlib.metadata.version("deepspeed"):
        raise RuntimeError(f"`import deepspeed` gave {deepspeed!r}, not the zeroshard alias in {alias_dir}.")


def tiny_llama_config(tie: bool = False, **overrides: Any):
    from transformers import LlamaConfig

    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def token_rows(rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def reset_trainer_state(task_env: dict[str, str]) -> None:
    """Between two Trainers in one process. Accelerate keeps one AcceleratorState (and
    transformers one ZeRO-3 config) per process, as a script with one Trainer would; and an
    Accelerator with DeepSpeed leaves ACCELERATE_USE_DEEPSPEED=true behind, which would turn the
    next run without `deepspeed=` into a DeepSpeed run: every ACCELERATE_* variable not in
    `task_env` (the environment the task started with) goes."""
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=False)
    unset_hf_deepspeed_config()
    for name in [n for n in os.environ if n.startswith("ACCELERATE_") and n not in task_env]:
        del os.environ[name]
