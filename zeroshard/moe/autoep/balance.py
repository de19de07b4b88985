"""Auxiliary-loss-free load balancing for AutoEP routers with a selection bias (DeepSeek-V3's
`e_score_correction_bias`), torchtitan's `load_balance_coeff`: beyond DeepSpeed 0.19, whose
AutoEP refuses any non-null value.

Each layer counts the routes per expert over every forward of an accumulation window; at the
optimizer step the counts are summed over every rank (each rank routes its own tokens) and
the bias moves by `coeff * sign(mean - count)`, centred (so its mean does not drift): an
overloaded expert becomes a little less likely to be chosen, an idle one more. The weights
still come from the unbiased scores, so the bias changes the choice only.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

__all__ = ["LoadBalancer", "balance_step"]


def balance_step(bias: torch.Tensor, counts: torch.Tensor, coeff: float) -> torch.Tensor:
    """The bias update for one layer: coeff * sign(mean(counts) - counts), centred."""
    counts = counts.to(torch.float32)
    delta = coeff * torch.sign(counts.mean() - counts)
    delta = delta - delta.mean()
    return bias + delta.to(bias.dtype)


class LoadBalancer:
    """Moves every AutoEP layer's selection bias at each optimizer step (the engine calls
    `step` at the boundary)."""

    def __init__(self, layers: list[nn.Module], coeff: float, group: Group) -> None:
        self.layers = layers
        self.coeff = coeff
        self.group = group
        for layer in layers:
            layer.count_tokens = True

    def step(self, applied: bool = True) -> None:
        if not self.layers:
            return
        first = self.layers[0]
        counts = torch.stack([
            layer.tokens_per_expert if layer.tokens_per_expert is not None
            else torch.zeros(layer.num_experts, device=first.router.gate.weight.device)
            for layer in self.layers
        ])
        comm.all_reduce(counts, group=self.group, tag="autoep_balance")
        with torch.no_grad():
            for layer, layer_counts in zip(self.layers, counts, strict=True):
                layer.tokens_per_expert = None
                if applied:
                    bias = layer.router.e_score_correction_bias
                    bias.copy_(balance_step(bias, layer_counts.to(bias.device), self.coeff))
