"""Rank-side scenarios for tests/dist/optim/test_muon_heads.py: per-head Muon on tiny Hugging
Face models (Llama with grouped-query attention, DeepSeek-V3 with MLA) through the engine,
configured by `per_head_muon` / `per_head_muon_output` alone (the presets tag the weights)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.unit.optim.muon_models import tiny

STEPS, VOCAB, SEQ = 2, 32, 5
MUON_LR, ADAM_LR, MOMENTUM, WD = 0.05, 0.01, 0.9, 0.1
CLIP = 1.0  # DeepSpeed's default, written out: it acts here (the global norm is above 1)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1000 * step + rank))


def muon_config(stage: int, per_head: bool = True) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "Muon", "params": {
            "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD,
            "per_head_muon": per_head, "per_head_muon_output": per_head,
        }},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def train_cases(cases: list[tuple[str, int, bool]]) -> list[dict[str, Any]]:
    """Per (family, stage, per_head): every parameter's full fp32 master after each step, and the
    owner rank of every Newton-Schulz matrix (a head block is one)."""
    rank = dist.get_rank()
    results = []
    for family, stage, per_head in cases:
        config = muon_config(stage, per_head)
        with zeroshard.zero.Init(config_dict_or_path=config, enabled=stage == 3):  # heads read from ds_shape
            model = tiny(family)
        engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                                      config=config)
        masters = []
        for step in range(STEPS):
            x = batch(rank, step)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
            masters.append({n: zeroshard.safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()})
        results.append({"masters": masters, "owners": optimizer.owner_of()})
    return results
