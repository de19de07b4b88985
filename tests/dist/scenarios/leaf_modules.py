"""Rank-side scenario for tests/dist/sharding/test_leaf_modules.py: an MoE block whose experts run
data-dependently (each rank routes its tokens to a different expert), marked as a stage-3
leaf so that it gathers as one."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.utils import set_z3_leaf_modules, z3_leaf_module


class Expert(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class MoEBlock(nn.Module):
    """Routes each row to the expert `route` names: only the experts that get rows run."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(Expert(dim) for _ in range(experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in route.unique().tolist():
            rows = route == e
            out[rows] = self.experts[e](x[rows])
        return out + x


class Net(nn.Module):
    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moe = MoEBlock(dim, experts)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        return self.out(self.moe(self.inp(x), route)).pow(2).mean()


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 8, generator=gen), torch.full((4,), rank, dtype=torch.long)  # rank r -> expert r


def leaf_moe(stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    marked = set_z3_leaf_modules(model, [MoEBlock])
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(),
        config={"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                # Experts as units of their own: without the leaf mark, each rank would gather
                # only the expert its rows reach, and the ranks' collectives would not match.
                "zeroshard": {"unit_module_classes": ["Expert"]},
                "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}},
    )
    engine.backward(engine(*_batch(dist.get_rank())))
    grads = {n: zeroshard.safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
    # The data-parallel gradient: the mean over ranks of each rank's loss, in one process.
    world = dist.get_world_size()
    loss = sum(reference(*_batch(r)) for r in range(world)) / world
    loss.backward()
    expected = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in reference.named_parameters()}
    return {
        "marked": [type(m).__name__ for m in marked],
        "leaf": z3_leaf_module(model.moe) and not z3_leaf_module(model.moe.experts[0]),
        "units": [u.name for u in engine.units],
        "grads": grads,
        "expected": expected,
    }
