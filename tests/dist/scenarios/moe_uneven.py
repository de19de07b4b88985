"""Rank-side scenarios for tests/dist/moe/test_moe_uneven_tokens.py: an MoE model whose ranks
hold different numbers of tokens (dynamic padding in training, a smaller last batch in
evaluation), with drops (`drop_tokens=True`, capacity factor 1).

The weights are a function of each parameter's global name (expert parameters named by their
global expert index), so the test's one-process reference (ep_size 1) holds the same model.
Top-2 without second-expert sampling: routing draws nothing from the RNG, so the reference
needs no replay of each rank's generator.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import global_expert_names

HIDDEN, IN, OUT, NUM_EXPERTS, K = 8, 5, 3, 4, 2
BATCH = 2  # sequences per micro-batch; the sequence length is each rank's padded length
GA, STEPS, LR, CLIP = 2, 3, 1e-2, 0.5
# Padded sequence length per (step, micro-step) for ranks 0 and 1: 2 x 8 = 16 tokens against
# 2 x 20 = 40 (dynamic padding), the longer batch on either rank, and once equal.
SEQ_LENGTHS = [[(8, 20), (20, 8)], [(20, 20), (8, 20)], [(20, 8), (8, 8)]]
# Evaluation: a full batch on rank 0, the last, smaller one on rank 1.
EVAL_SEQ = (20, 7)


class UnevenMoENet(nn.Module):
    def __init__(self, ep_size: int) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
        self.moe = nn.ModuleList([
            MoE(HIDDEN, expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=K, min_capacity=2,
                top2_2nd_expert_sampling=False)
            for _ in range(2)
        ])
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        aux = h.new_zeros(())
        for moe in self.moe:
            out, l_aux, _ = moe(self.norm(h))
            h, aux = h + out, aux + l_aux
        return F.mse_loss(self.head(h), y) + 0.01 * aux


def global_names(model: nn.Module) -> dict[str, nn.Parameter]:
    experts = global_expert_names(model)
    return {experts.get(id(p), name): p for name, p in model.named_parameters()}


def build_model(ep_size: int) -> UnevenMoENet:
    model = UnevenMoENet(ep_size)
    with torch.no_grad():
        for name, p in global_names(model).items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() > 1 else 0.1))
    return model


def micro_batch(rank: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(BATCH, seq, IN, generator=g), torch.randn(BATCH, seq, OUT, generator=g)


def train_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return micro_batch(rank, SEQ_LENGTHS[step][micro][rank], 100 * step + micro)


def eval_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return micro_batch(rank, EVAL_SEQ[rank], 7_000)


def engine_config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GA,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }


def train_uneven(stages: list[int]) -> list[dict[str, Any]]:
    """Per stage (ep_size 2 = the world): each step's fp32 masters by global name, and the
    evaluation loss of this rank's (uneven) batch after training; every collective of the
    first forward."""
    rank = dist.get_rank()
    results = []
    for stage in stages:
        engine, _, _, _ = zeroshard.initialize(model=build_model(dist.get_world_size()), config=engine_config(stage))
        out: dict[str, Any] = {"masters": []}
        for step in range(STEPS):
            for micro in range(GA):
                x, y = train_batch(rank, step, micro)
                if step == micro == 0:
                    with zeroshard.comm.recording() as log:
                        loss = engine(x, y)
                    out["first_forward"] = [(r.op, r.tag, r.numel) for r in log.records if r.tag.startswith("moe")]
                else:
                    loss = engine(x, y)
                engine.backward(loss)
                engine.step()
            out["masters"].append(
                {n: zeroshard.safe_get_full_fp32_param(p) for n, p in global_names(engine.module).items()}
            )
        engine.eval()
        with torch.no_grad():
            out["eval_loss"] = engine(*eval_batch(rank)).item()
        results.append(out)
    return results
