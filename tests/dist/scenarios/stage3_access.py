"""Rank-side scenarios for tests/dist/sharding/test_stage3_access.py: parameters reached other ways
than through their unit's own forward, and parameters read outside a gather."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.dist.scenarios.common import PRECISION_SECTIONS
from zeroshard.zero import GatheredParameters

VOCAB, DIM, BLOCKS = 11, 8, 3


class DictBlocks(nn.Module):
    """Blocks as a ModuleList of ModuleDicts (each a unit) whose submodules the root's forward
    calls directly, never the block itself; and block 0's Linear called again from the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(DIM), "linear": nn.Linear(DIM, DIM)}) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block["linear"](block["norm"](h)))
        h = self.blocks[0].linear(h)  # a unit's submodule from the root, after the unit ran
        return F.cross_entropy(self.head(h).float().reshape(-1, VOCAB), targets.reshape(-1))


def _config(stage: int, mode: str) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    config.update(PRECISION_SECTIONS[mode])
    return config


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = 2 * dist.get_world_size()
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (rows, 5), generator=g)
        out.append((tokens, torch.randint(0, VOCAB, (rows, 5), generator=g)))
    return out


def train_dict_blocks(stage: int, mode: str, steps: int = 3) -> dict[str, Any]:
    """Train DictBlocks; returns the losses, the full module parameters after training, and
    what reading the parameters outside a gather gave (stage 3)."""
    engine, _, _, _ = zeroshard.initialize(model=DictBlocks(), config=_config(stage, mode))
    rank, micro = dist.get_rank(), 2
    losses = []
    for tokens, targets in _batches(steps):
        rows = slice(rank * micro, (rank + 1) * micro)
        loss = engine(tokens[rows], targets[rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    params = list(engine.module.named_parameters())
    with GatheredParameters([p for _, p in params]):
        full = {name: p.detach().clone() for name, p in params}
        buffer = io.BytesIO()
        torch.save(engine.module.state_dict(), buffer)  # inside the gather: the full tensors
    out: dict[str, Any] = {"losses": losses, "full": full, "saved": buffer.getvalue()}
    if stage == 3:
        p = dict(params)["blocks.1.linear.weight"]
        out["outside"] = {
            "numel": p.numel(), "shape": tuple(p.shape), "ds_shape": tuple(p.ds_shape),
            "sum": p.sum().item(), "clone_numel": p.clone().numel(),
            "deepcopy_numels": [q.numel() for q in copy.deepcopy(engine.module).parameters()],
        }
        try:
            engine.module.state_dict()
            out["state_dict_error"] = None
        except RuntimeError as exc:
            out["state_dict_error"] = str(exc)
        try:
            _ = p @ torch.ones(DIM, dtype=p.dtype)
            out["use_error"] = None
        except RuntimeError as exc:
            out["use_error"] = type(exc).__name__
    return out
