"""The whole sequence from every rank's slice: a differentiable all-gather along the sequence.

Slices may have any lengths: shapes are exchanged first (zeroshard/sequence/shapes.py), and the
padding that makes the all-gather's pieces equal is removed from the result. Every other
dimension must be the same on every rank; if not, every rank raises a ValueError naming the
shapes (the all-gather's sizes would differ, which gloo answers with an abort). Used by AutoSP's ViT wrapper (which
attends over the whole patch sequence), the fusion adapters (which gather the token ids) and
`padding.unshard_sequence`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.sequence.shapes import gather_shapes

__all__ = ["gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    """Concatenate every rank's slice along `dim` (slices of any length)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: comm.Group, dim: int) -> Tensor:
        shapes = [rank[0] for rank in gather_shapes([tuple(x.shape)], group, x.device)]
        others = {s[:dim] + s[dim + 1 :] if len(s) == x.dim() else s for s in shapes}
        if len(others) > 1:
            listed = "; ".join(f"rank {r}: {list(s)}" for r, s in zip(group.ranks, shapes, strict=True))
            raise ValueError(
                f"gather_sequence along dim {dim} over ranks {list(group.ranks)}: the slices differ in another "
                f"dimension ({listed}). Only the sequence dimension may differ between the ranks' slices."
            )
        sizes = [s[dim] for s in shapes]
        longest = max(sizes)
        moved = x.movedim(dim, 0)
        padded = moved.new_zeros((longest, *moved.shape[1:]))
        padded[: moved.shape[0]] = moved
        gathered = padded.new_empty((group.size * longest, *moved.shape[1:]))
        comm.all_gather(gathered, padded.contiguous(), group=group, tag="sequence")
        pieces = [gathered[r * longest : r * longest + n] for r, n in enumerate(sizes)]
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return torch.cat(pieces).movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        # Every rank's output depends on every slice: sum the gradients, keep this rank's rows.
        total = grad.contiguous().clone()
        comm.all_reduce(total, group=ctx.group, tag="sequence")
        start = sum(ctx.sizes[: ctx.group.rank])
        return total.narrow(ctx.dim, start, ctx.sizes[ctx.group.rank]), None, None


def gather_sequence(x: Tensor, group: Any, dim: int) -> Tensor:
    """Every rank's slice of `x` concatenated along `dim` in group-rank order (differentiable)."""
    return _GatherSequence.apply(x, comm.as_group(group), dim)


def _slice_lengths(n: int, group: comm.Group, device: torch.device) -> list[int]:
    lengths = torch.tensor([n], dtype=torch.long, device=device)
    everyone = lengths.new_empty(group.size)
    comm.all_gather(everyone, lengths, group=group, tag="sequence")
    return everyone.tolist()
