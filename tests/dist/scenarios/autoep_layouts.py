"""Rank-side scenarios for tests/dist/moe/test_autoep_layouts.py: a remote-code-style
DeepSeek-V3 (experts an nn.ModuleList of MLPs, tests/unit/moe/remote_code_models.py) swapped by
AutoEP with default keys at autoep_size 2, trained on batches of different token counts per
rank, then exported.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.unit.moe.remote_code_models import VOCAB, remote_deepseek_v3

LR, CLIP, STEPS = 0.1, 1.0, 2
# Tokens per rank differ (2 x 5 against 3 x 9), so the exchange's split sizes differ too.
SHAPES = ((2, 5), (3, 9))


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + 10 * step + rank)
    return torch.randint(0, VOCAB, SHAPES[rank], generator=g)


def engine_config(stage: int) -> dict[str, Any]:
    # SGD: each update is linear in the gradient, so the one-process reference's rounding
    # differences stay at the gradients' level (AdamW's first steps are lr x sign(g)).
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "expert_parallel": {"enabled": True, "autoep_size": dist.get_world_size()},
        "steps_per_print": 1000,
    }


def by_global_name(engine) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master (collective), stacked experts split by global expert."""
    out: dict[str, torch.Tensor] = {}
    for name, p in engine.module.named_parameters():
        value = zeroshard.safe_get_full_fp32_param(p)
        if getattr(p, "allreduce", True) is False:
            layer = engine.module.get_submodule(name.rsplit(".experts.", 1)[0])
            for j, row in enumerate(value):
                out[f"{name}[{layer.global_expert_index(j)}]"] = row
        else:
            out[name] = value
    return out


def train_and_export(stage: int, root: str) -> dict[str, Any]:
    """STEPS steps on this rank's uneven batches; the masters after each; then
    save_16bit_model and save_checkpoint under `root`."""
    rank = dist.get_rank()
    model = remote_deepseek_v3()
    engine, _, _, _ = zeroshard.initialize(model=model, config=engine_config(stage))
    out: dict[str, Any] = {"masters": [], "losses": []}
    for step in range(STEPS):
        x = batch(rank, step)
        loss = engine(x, labels=x)
        engine.backward(loss)
        engine.step()
        out["losses"].append(loss.item())
        out["masters"].append(by_global_name(engine))
    engine.save_16bit_model(root, f"remote-{stage}.safetensors")
    engine.save_checkpoint(f"{root}/ckpt-{stage}", tag="t")
    return out
