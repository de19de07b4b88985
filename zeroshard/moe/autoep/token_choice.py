"""DeepSpeed's `TokenChoiceTopKRouter` (its `deepspeed.moe.ep_router`): AutoEP's router built
from DeepSpeed's arguments, returning what DeepSpeed's returns.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from zeroshard.moe.autoep.layer import AutoEPRouter
from zeroshard.moe.autoep.presets import MoEPreset, RoutingSettings

__all__ = ["TokenChoiceTopKRouter"]


class TokenChoiceTopKRouter(AutoEPRouter):
    """Token-choice top-k routing, DeepSpeed's constructor: the gate in the input's dtype,
    scores in fp32, an optional group-limited choice (`num_expert_groups`, `num_limited_groups`,
    groups scored by `group_score_func` "top2_sum" or "max").

    Raises:
        ValueError: `gate_bias=True` (zeroshard's gate has no bias), an unknown `score_func` or
            `group_score_func`, or group settings that do not divide the experts.
    """

    def __init__(
        self, dim: int, num_experts: int, num_expert_groups: int | None, num_limited_groups: int | None, top_k: int,
        score_func: str, route_norm: bool, route_scale: float, gate_bias: bool, group_score_func: str = "top2_sum",
    ) -> None:
        if gate_bias:
            raise ValueError("TokenChoiceTopKRouter(gate_bias=True): zeroshard's router gate has no bias. Pass False.")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"TokenChoiceTopKRouter: score_func must be 'softmax' or 'sigmoid', got {score_func!r}.")
        if group_score_func not in ("top2_sum", "max"):
            raise ValueError(
                f"TokenChoiceTopKRouter: group_score_func must be 'top2_sum' or 'max', got {group_score_func!r}."
            )
        if (num_expert_groups is None) != (num_limited_groups is None):
            raise ValueError(
                f"TokenChoiceTopKRouter: num_expert_groups ({num_expert_groups}) and num_limited_groups "
                f"({num_limited_groups}) go together. Set both, or neither."
            )
        limited_ok = num_limited_groups is not None and 1 <= num_limited_groups <= (num_expert_groups or 0)
        if num_expert_groups is not None and (num_experts % num_expert_groups or not limited_ok):
            raise ValueError(
                f"TokenChoiceTopKRouter: num_expert_groups={num_expert_groups} must divide num_experts ({num_experts}) "
                f"and num_limited_groups={num_limited_groups} lie between 1 and it."
            )
        preset = MoEPreset((), "num_local_experts", score_func, route_norm, group_score=group_score_func)
        settings = RoutingSettings(
            None, preset, num_experts, top_k, score_func, route_norm, float(route_scale), num_expert_groups,
            num_limited_groups, {},
        )
        super().__init__(dim, settings, None)
        self.group_score_func = group_score_func
        # nn.Linear's initialisation, as DeepSpeed's gate is an nn.Linear.
        nn.init.kaiming_uniform_(self.gate.weight, a=math.sqrt(5))

    def forward(self, x: Tensor, expert_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        """x [T, dim] -> (routing weights [T, top_k] fp32, selected experts [T, top_k],
        tokens per expert [num_experts] int32)."""
        _, weights, selected = super().forward(x, expert_bias)
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=selected.device)
        counts.scatter_add_(0, selected.reshape(-1), torch.ones_like(selected.reshape(-1), dtype=torch.int32))
        return weights, selected, counts
