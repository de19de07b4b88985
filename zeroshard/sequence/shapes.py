"""Agree tensor shapes across a sequence-parallel group before an exchange whose sizes they set.

An all-to-all or all-gather whose sizes come from each rank's own tensors (its local sequence
length, its batch) does not fail cleanly when the ranks disagree: gloo aborts the process
(SIGABRT, "Received data size doesn't match expected size") and NCCL may hang or mix data. So
the shapes go first, in one all-gather of a fixed size (`MAX_DIMS` per tensor, whatever the
shapes), and a disagreement becomes the same ValueError on every rank, naming the exchange
and every rank's shapes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroshard.comm import collectives as comm

__all__ = ["MAX_DIMS", "gather_shapes", "agree_shapes"]

MAX_DIMS = 8  # dims a shape may have; slots per tensor in the all-gather (plus its dim count)


def gather_shapes(shapes: Sequence[Sequence[int]], group: comm.Group, device: torch.device) -> list[list[tuple]]:
    """Every rank's `shapes` (each rank passes the same number of them), in group-rank order.

    One all-gather of len(shapes) x (1 + MAX_DIMS) integers and one host read.
    """
    if group.size == 1:
        return [[tuple(s) for s in shapes]]
    flat: list[int] = []
    for shape in shapes:
        if len(shape) > MAX_DIMS:  # a property of the model's code, the same on every rank
            raise ValueError(f"a tensor of {len(shape)} dims: sequence parallelism handles at most {MAX_DIMS}.")
        flat += [len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]
    mine = torch.tensor(flat, dtype=torch.int64, device=device).view(len(shapes), 1 + MAX_DIMS)
    everyone = mine.new_empty((group.size, *mine.shape))
    comm.all_gather(everyone, mine, group=group, tag="sequence_shapes")
    rows = everyone.tolist()
    return [[tuple(t[1 : 1 + t[0]]) for t in rank] for rank in rows]


def agree_shapes(
    tensors: dict[str, torch.Tensor], group: comm.Group, what: str, fix: str, vary_dim: int | None = None
) -> list[list[tuple]]:
    """Every rank's shapes of `tensors`, in group-rank order; ValueError on every rank of `group`
    unless every rank holds them with the same shapes, dimension `vary_dim` (the heads a rank
    holds after an uneven split) excepted (the names say which is which in the message; `fix`
    says what to do)."""
    names = list(tensors)
    device = next(iter(tensors.values())).device
    everyone = gather_shapes([tuple(t.shape) for t in tensors.values()], group, device)

    def compared(shapes: list[tuple]) -> list[tuple]:
        if vary_dim is None:
            return shapes
        return [s[:vary_dim] + s[vary_dim + 1 :] if len(s) > vary_dim else s for s in shapes]

    if all(compared(shapes) == compared(everyone[0]) for shapes in everyone):
        return everyone
    listed = "; ".join(
        f"rank {r}: " + ", ".join(f"{n} {list(s)}" for n, s in zip(names, shapes, strict=True))
        for r, shapes in zip(group.ranks, everyone, strict=True)
    )
    raise ValueError(f"{what} over ranks {list(group.ranks)}: the ranks hold different shapes ({listed}). {fix}")
