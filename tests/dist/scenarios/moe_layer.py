"""Rank-side scenarios for tests/dist/moe/test_moe_layer.py: the MoE layer at world size 4.

Weights are a function of the global expert index (`expert_state`), so a layer with any
ep_size, and the single-process reference layer in the test, hold the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.moe.layer import MoE
from zeroshard.utils import groups

HIDDEN = 6
NUM_EXPERTS = 4


@dataclass(frozen=True)
class LayerCase:
    ep_size: int
    k: int
    drop_tokens: bool = False
    all_to_expert_zero: bool = False
    uneven: bool = False  # with drops: 3, 7, 11, 15 tokens on ranks 0-3

    @property
    def label(self) -> str:
        return f"ep{self.ep_size}-k{self.k}-{'drop' if self.drop_tokens else 'dropless'}" + (
            "-zero-token-experts" if self.all_to_expert_zero else ""
        ) + ("-uneven" if self.uneven else "")


def make_expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 10), nn.Tanh(), nn.Linear(10, HIDDEN))


def expert_state(global_index: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + global_index)
    return {name: torch.randn(t.shape, generator=g) * 0.5 for name, t in make_expert().state_dict().items()}


def gate_weight(case: LayerCase) -> torch.Tensor:
    if case.all_to_expert_zero:  # inputs are positive: every token's top choice is expert 0
        return torch.tensor([[1.0] * HIDDEN] + [[-1.0] * HIDDEN] * (NUM_EXPERTS - 1))
    return torch.randn(NUM_EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(7))


def rank_batch(case: LayerCase, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, loss weights) of `rank`; token counts differ per rank when nothing is dropped
    and in the uneven cases (the agreed capacity must cover that)."""
    tokens = 3 + 4 * rank if case.uneven else 8 if case.drop_tokens else 5 + rank
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g)
    if case.all_to_expert_zero:
        x = x.abs() + 0.1
    return x, torch.randn(tokens, HIDDEN, generator=g)


def build_layer(case: LayerCase, ep_size: int) -> MoE:
    moe = MoE(
        HIDDEN, make_expert(), num_experts=NUM_EXPERTS, ep_size=ep_size, k=case.k, min_capacity=1,
        drop_tokens=case.drop_tokens, use_rts=False, top2_2nd_expert_sampling=False,
    )
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(gate_weight(case))
        for j, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            module.load_state_dict(expert_state(moe.global_expert_index(j)))
    return moe


def layer_cases(cases: list[LayerCase]) -> list[dict[str, Any]]:
    """Forward and backward of `(output * w).sum()` on this rank's batch; the output, the input
    and gate gradients, each local expert's gradients by global index, every collective."""
    results = []
    for case in cases:
        moe = build_layer(case, case.ep_size)
        x, w = rank_batch(case, dist.get_rank())
        x.requires_grad_(True)
        with zeroshard.comm.recording() as log:
            out, l_aux, counts = moe(x)
            (out * w).sum().backward()
        results.append({
            "out": out.detach(),
            "x_grad": x.grad,
            "gate_grad": moe.deepspeed_moe.gate.wg.weight.grad,
            "expert_grads": {
                moe.global_expert_index(j): {n: p.grad for n, p in module.named_parameters()}
                for j, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts)
            },
            "counts": counts,
            "collectives": [(r.op, r.tag, r.group, r.numel) for r in log.records],
            "ep_ranks": groups._get_expert_parallel_group_ranks(moe.expert_group_name),
            "edp_ranks": groups._get_expert_data_parallel_group_ranks(moe.expert_group_name),
        })
    return results


def bad_ep_size() -> str:
    try:
        MoE(HIDDEN, make_expert(), num_experts=3, ep_size=3)
    except ValueError as error:
        return str(error)
    return "no error"


def uneven_all_to_all() -> dict[str, Any]:
    """comm.all_to_all_single with split sizes: rank r sends j + 1 rows of value 10 r + j to
    rank j, so it receives r + 1 rows from each rank j, of value 10 j + r."""
    rank, world = dist.get_rank(), dist.get_world_size()
    send = torch.cat([torch.full((j + 1, 2), float(10 * rank + j)) for j in range(world)])
    recv = torch.empty((rank + 1) * world, 2)
    with zeroshard.comm.recording() as log:
        zeroshard.comm.collectives.all_to_all_single(
            recv, send, [rank + 1] * world, [j + 1 for j in range(world)],
            group=zeroshard.comm.world_group(), tag="test",
        )
    return {"recv": recv, "records": [(r.op, r.numel, r.tag, r.group) for r in log.records]}
