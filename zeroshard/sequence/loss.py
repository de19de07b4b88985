"""The loss of a sequence-parallel group: token-weighted over its ranks.

Each rank of a sequence group sees a slice of the same samples, with its own number of
counted tokens (padding and -100 labels are not counted, and they fall unevenly on the
slices). The mean over the group's tokens is sum(loss sums) / sum(token counts), not the mean
of the ranks' means. `token_weighted_loss` returns that value on every rank; its gradient on
rank r is d(loss sum_r)/T, so the engine's sum of the sequence ranks' gradients is the
gradient of the group mean, exactly as one rank with the whole sequence would compute it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm

__all__ = ["token_weighted_loss"]


class _GroupTokenMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, loss_sum: Tensor, num_tokens: Tensor, group: comm.Group) -> Tensor:
        totals = torch.stack([loss_sum.detach().float(), num_tokens.detach().float()])
        comm.all_reduce(totals, group=group, tag="loss")
        ctx.total_tokens = totals[1].clamp(min=1.0)  # a group with no counted token has loss 0
        return (totals[0] / ctx.total_tokens).to(loss_sum.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        # Only this rank's share: the other ranks' sums reach their own parameters' gradients.
        return grad / ctx.total_tokens.to(grad.dtype), None, None


def token_weighted_loss(loss_sum: Tensor, num_tokens: Tensor | int, group: Any) -> Tensor:
    """The mean loss over every counted token of the sequence group.

    Args:
        loss_sum: this rank's summed token loss (e.g. cross entropy with reduction="sum").
        num_tokens: this rank's counted tokens (e.g. `(shift_labels != -100).sum()`).
        group: the sequence-parallel group (torch ProcessGroup or `zeroshard.comm.Group`).
    """
    if not torch.is_tensor(num_tokens):
        num_tokens = torch.tensor(num_tokens, device=loss_sum.device)
    return _GroupTokenMean.apply(loss_sum, num_tokens, comm.as_group(group))
