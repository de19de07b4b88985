"""The experts of an MoE layer: one deep copy of the user's expert module per local expert,
as DeepSpeed lays them out (`<moe>.deepspeed_moe.experts.deepspeed_experts.<j>`)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Experts(nn.Module):
    """`num_local_experts` copies of `expert`; each parameter is marked as an expert parameter
    (`allreduce = False`, `group_name = expert_group_name`, DeepSpeed's markers, which
    `zeroshard.moe.utils.is_moe_param` and the engine read to shard it over its
    expert-data-parallel group instead of the whole world)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [ep_size, num_local_experts, capacity, d_model]: local expert j takes column j
        (its tokens from every rank of the expert-parallel group)."""
        outputs = []
        for chunk, module in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True):
            out = module(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts
        return torch.cat(outputs, dim=1)
