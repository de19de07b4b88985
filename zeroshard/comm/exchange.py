"""The one differentiable exchange: an all-to-all along dim 0, with equal or uneven splits,
whose backward is the same exchange with the splits swapped.

Every feature that moves rows between the ranks of a group and needs gradients to come back
uses it: the MoE layer's dispatch and combine (equal capacity slots per rank,
zeroshard/moe/dispatcher.py), AutoEP's dropless exchange (counts per rank,
zeroshard/moe/autoep/dispatch.py) and Ulysses sequence parallelism (heads one way, sequence the
other, zeroshard/sequence/layer.py). What differs between them is only how they lay out the rows
before and after, which they do with ordinary (differentiable) tensor ops.

Several tensors can be exchanged at once (`all_to_all_many`: Ulysses' query, key and value):
they are issued together and waited for in order, so the transport moves them concurrently,
and with a CUDA side stream the first runs on the current stream while the rest run on the
side stream (DeepSpeed's `sp_stream`). Their gradients go back the same way, together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

__all__ = ["Splits", "all_to_all", "all_to_all_many"]

# Rows sent to (or received from) each rank of the group, in group-rank order; None: equal slices.
Splits = list[int] | None


def _explicit(x: Tensor, send: Splits, recv: Splits, size: int, tag: str) -> tuple[list[int], list[int]]:
    """Both splits as row counts. Equal slices of `x`'s rows for a None, on either side (every
    rank then sends and receives rows/P per peer); explicit lists are what the backward swaps."""
    rows = x.shape[0]
    if (send is None or recv is None) and rows % size:
        raise ValueError(
            f"all_to_all '{tag}': {rows} rows cannot be split into {size} equal slices. Pass the split sizes."
        )
    equal = [rows // size] * size
    return (equal if send is None else list(send)), (equal if recv is None else list(recv))


def _issue(x: Tensor, send: list[int], recv: list[int], group: Group, tag: str) -> tuple[Tensor, Any]:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    work = comm.all_to_all_single(out, x.contiguous(), recv, send, group=group, tag=tag, async_op=True)
    return out, work


def _exchange(items: list[tuple[Tensor, list[int], list[int]]], group: Group, tag: str, stream: Any) -> list[Tensor]:
    """Issue every exchange, then wait for each in order (the numbers do not depend on `stream`)."""
    first = items[0][0]
    if stream is not None and first.is_cuda and isinstance(stream, torch.cuda.Stream) and len(items) > 1:
        current = torch.cuda.current_stream(first.device)
        stream.wait_stream(current)  # the inputs were made on the current stream
        with torch.cuda.stream(stream):
            side = [_issue(x, send, recv, group, tag) for x, send, recv in items[1:]]
            for x, _, _ in items[1:]:
                x.record_stream(stream)  # alive until the side stream is done with it
        x0, send0, recv0 = items[0]
        mine, work = _issue(x0, send0, recv0, group, tag)
        if work is not None:
            work.wait()
        with torch.cuda.stream(stream):
            for _, side_work in side:
                if side_work is not None:
                    side_work.wait()
        current.wait_stream(stream)
        results = [mine]
        for out, _ in side:
            out.record_stream(current)
            results.append(out)
        return results
    issued = [_issue(x, send, recv, group, tag) for x, send, recv in items]
    for _, work in issued:
        if work is not None:
            work.wait()
    return [out for out, _ in issued]


class _AllToAll(torch.autograd.Function):
    """Forward: each tensor's rows to the ranks its send splits say. Backward: each gradient's
    rows back, receive and send splits swapped."""

    @staticmethod
    def forward(ctx: Any, group: Group, tag: str, stream: Any, splits: tuple[tuple[list[int], list[int]], ...],
                *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.args = (group, tag, stream, splits)
        items = [(x, send, recv) for x, (send, recv) in zip(tensors, splits, strict=True)]
        return tuple(_exchange(items, group, tag, stream))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        group, tag, stream, splits = ctx.args
        items = [(g, recv, send) for g, (send, recv) in zip(grads, splits, strict=True)]
        return (None, None, None, None, *_exchange(items, group, tag + "_grad", stream))


def all_to_all_many(
    items: list[tuple[Tensor, Splits, Splits]], group: Group, tag: str, stream: Any = None
) -> list[Tensor]:
    """Exchange several tensors over `group` at once, differentiably.

    Args:
        items: (tensor, send splits, receive splits) per tensor; splits are row counts per
            group rank along dim 0, None for equal slices.
        group: the ranks exchanging; on a group of one every tensor comes back as it is.
        tag: the collective recorder's tag (the backward's is `tag + "_grad"`).
        stream: a CUDA side stream for every tensor but the first (DeepSpeed's `sp_stream`);
            ignored for CPU tensors.
    """
    if group.size == 1:
        return [x for x, _, _ in items]
    splits = tuple(_explicit(x, send, recv, group.size, tag) for x, send, recv in items)
    return list(_AllToAll.apply(group, tag, stream, splits, *(x for x, _, _ in items)))


def all_to_all(x: Tensor, group: Group, send: Splits = None, recv: Splits = None, tag: str = "") -> Tensor:
    """Exchange the rows of `x` over `group`, differentiably: `send[r]` rows (in order) go to group
    rank r, and `recv[r]` rows arrive from it, stacked in rank order. Equal slices when a split is
    None. The identity on a group of one."""
    return all_to_all_many([(x, send, recv)], group, tag)[0]
