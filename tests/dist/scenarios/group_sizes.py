"""Rank-side scenario for tests/dist/config/test_group_sizes.py: what `initialize` says about a
group size the world cannot be cut into."""

from __future__ import annotations

from typing import Any

import torch

import zeroshard


def initialize_error(extra: dict[str, Any]) -> str:
    """`initialize`'s error message for the base config plus `extra` ("" if it accepted it)."""
    from tests.dist.scenarios.autoep import build_hf

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra}
    model = build_hf("mixtral") if "expert_parallel" in extra else torch.nn.Linear(2, 2)
    try:
        zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return ""
