"""The differentiable exchanges of tensor parallelism (Megatron's f and g, DeepSpeed's
ColumnParallel / RowParallel / GatherFromTensorParallelRegion), over an explicit `Group`.

Each runs its collective through this package's functions, so `recording()` sees it with the
dtype on the wire, tagged `tp.forward` or `tp.backward` (docs/tensor-parallel.md counts them per
step), and a peer that stopped is a `CollectiveError` naming it. On a group of one they are the
identity.

- `copy_to_tensor_parallel(x)`: the input of column-split layers. Identity forward; backward
  sums the input's gradient over the group (each rank computed it from its output slice only).
- `reduce_from_tensor_parallel(y)`: the output of row-split layers. Forward sums the partial
  products over the group; backward is the identity (every rank needs the whole gradient).
- `gather_from_tensor_parallel(y)`: a column-split output every rank needs whole (an untied LM
  head): forward all-gathers the last dimension; backward keeps this rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

__all__ = ["copy_to_tensor_parallel", "reduce_from_tensor_parallel", "gather_from_tensor_parallel"]

FORWARD_TAG = "tp.forward"
BACKWARD_TAG = "tp.backward"


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)  # a new node, so the backward below runs exactly once per use

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # In place, as Megatron and DeepSpeed do: the incoming gradient is this node's alone.
        grad = grad.contiguous()
        comm.all_reduce(grad, group=ctx.group, tag=BACKWARD_TAG)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Group) -> torch.Tensor:
        # In place on the fresh matmul output (marked dirty, so autograd knows), no copy.
        if y.is_contiguous():
            ctx.mark_dirty(y)
        else:
            y = y.contiguous()
        comm.all_reduce(y, group=group, tag=FORWARD_TAG)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.width = group, y.shape[-1]
        gathered = y.new_empty((group.size, *y.shape))
        comm.all_gather(gathered, y.contiguous(), group=group, tag=FORWARD_TAG)
        # (parts, ..., width) -> (..., parts * width): piece p fills columns [p*width, (p+1)*width)
        return gathered.movedim(0, -2).reshape(*y.shape[:-1], group.size * y.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.group.rank * ctx.width
        return grad.narrow(-1, start, ctx.width).contiguous(), None


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """`x` unchanged; its gradient summed over `group` in backward."""
    return x if group.size == 1 else _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(y: torch.Tensor, group: Group) -> torch.Tensor:
    """`y` summed over `group`; the gradient passes through unchanged."""
    return y if group.size == 1 else _ReduceFromTensorParallel.apply(y, group)


def gather_from_tensor_parallel(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's `y` concatenated along the last dimension, in group-rank order."""
    return y if group.size == 1 else _GatherFromTensorParallel.apply(y, group)
