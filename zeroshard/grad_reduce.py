"""Bucketed reduction of a flat buffer's local gradient across ranks.

The one reduction every stage uses: divide the local gradient by world_size x k (DESIGN
section 4's gradient semantics), cast it to the wire dtype one bucket at a time, reduce
(all-reduce at stage 0, reduce-scatter at stages 1-3), and add the result into the flat's
reduced gradient in the accumulation dtype. Upcasting for a wider wire dtype happens one
bucket at a time, so the extra memory is bounded by `reduce_bucket_size`, never by the
model size.

A reduction is started (the collectives are issued asynchronously, so they overlap the rest
of the backward) and finished later (`PendingReduction.finish`); the engine finishes every
pending reduction before the backward returns.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import comm
from .flat import FlatParamGroup


class PendingReduction:
    """Collectives in flight for one flat buffer, and what to do when they complete."""

    def __init__(self, works: list, on_complete: list[Callable[[], None]], done: Callable[[], None]):
        self._works = works
        self._on_complete = on_complete
        self._done = done

    def finish(self) -> None:
        for work, complete in zip(self._works, self._on_complete, strict=True):
            if work is not None:
                work.wait()
            complete()
        self._done()


def start_reduce(flat: FlatParamGroup, divisor: int, bucket_numel: int) -> PendingReduction:
    """Issue the reduction of `flat.local_grad` into `flat.reduced_grad`.

    Every rank must call this for the same flats in the same order (it is a collective);
    a rank that has no local gradient for the flat contributes zeros.
    """
    local = flat.local_grad_buffer()
    if flat.policy.scatter:
        return _reduce_scatter(flat, local, divisor, bucket_numel)
    return _all_reduce(flat, local, divisor, bucket_numel)


def _all_reduce(flat: FlatParamGroup, local: torch.Tensor, divisor: int, bucket: int) -> PendingReduction:
    acc_dtype = flat.role.grad_accum_dtype
    wire_dtype = flat.role.reduce_dtype
    # Reduce in place when the local buffer already holds the accumulation dtype and no
    # reduced gradient is waiting: the buffer then simply becomes the reduced gradient, so
    # stage 0 holds one full gradient buffer, not two.
    in_place = flat.reduced_grad is None and local.dtype == acc_dtype
    target = local if in_place else torch.empty_like(local, dtype=acc_dtype)
    works, completions = [], []
    bucket = max(1, bucket)
    for start in range(0, flat.padded_numel, bucket):
        length = min(bucket, flat.padded_numel - start)
        chunk = target.narrow(0, start, length)
        torch.div(local.narrow(0, start, length).to(acc_dtype), divisor, out=chunk)
        if wire_dtype == acc_dtype:
            works.append(comm.all_reduce(chunk, tag="grad", async_op=True))
            completions.append(lambda: None)
        else:
            wire = chunk.to(wire_dtype)
            works.append(comm.all_reduce(wire, tag="grad", async_op=True))
            completions.append(lambda chunk=chunk, wire=wire: chunk.copy_(wire))
    if in_place:
        flat.adopt_local_as_reduced()  # filled in by the collectives; read only after finish()

        def done() -> None:
            pass
    else:
        flat.release_local_grad()

        def done() -> None:
            flat.reduced_grad_buffer().add_(target)

    return PendingReduction(works, completions, done)


def _reduce_scatter(flat: FlatParamGroup, local: torch.Tensor, divisor: int, bucket: int) -> PendingReduction:
    acc_dtype = flat.role.grad_accum_dtype
    wire_dtype = flat.role.reduce_dtype
    ws, shard_numel = flat.world_size, flat.shard_numel
    # Column block [c0, c1) of the (world_size, shard_numel) view is one bucket: row r of it
    # is the part of rank r's shard the bucket covers, so the reduce-scatter's r-th chunk
    # lands in rank r's shard.
    by_rank = local.view(ws, shard_numel)
    # Stage 1 with nothing reduced yet: the result goes straight into this rank's own slice
    # of the (persistent, full) local buffer, which then holds the reduced shard. Safe: each
    # bucket's input is copied out before its output can land, and buckets are disjoint.
    in_place = (
        flat.reduced_grad is None and local.dtype == acc_dtype and not flat.policy.reduce_every_backward
    )
    reduced = flat.shard_of(local) if in_place else flat.reduced_grad_buffer()
    works, completions = [], []
    cols = max(1, bucket // ws)
    for c0 in range(0, shard_numel, cols):
        c1 = min(shard_numel, c0 + cols)
        block = torch.div(by_rank[:, c0:c1].to(acc_dtype), divisor)  # a contiguous copy
        if wire_dtype != acc_dtype:
            block = block.to(wire_dtype)
        if in_place and wire_dtype == acc_dtype:
            out = reduced.narrow(0, c0, c1 - c0)
            works.append(comm.reduce_scatter(out, block, tag="grad", async_op=True))
            completions.append(lambda block=block: None)  # keeps `block` alive until finish()
            continue
        if in_place:  # a narrower wire dtype: land the result, then widen it into place
            out = torch.empty(c1 - c0, dtype=wire_dtype, device=local.device)
            works.append(comm.reduce_scatter(out, block, tag="grad", async_op=True))
            completions.append(
                lambda c0=c0, c1=c1, out=out, block=block: reduced.narrow(0, c0, c1 - c0).copy_(out)
            )
            continue
        out = torch.empty(c1 - c0, dtype=wire_dtype, device=local.device)
        works.append(comm.reduce_scatter(out, block, tag="grad", async_op=True))
        # `block` must outlive the collective: the closure keeps it alive until finish().
        completions.append(
            lambda c0=c0, c1=c1, out=out, block=block: reduced.narrow(0, c0, c1 - c0).add_(out)
        )
    if in_place:
        flat.adopt_local_as_reduced()
    else:
        flat.release_local_grad()  # every bucket was copied out above
    return PendingReduction(works, completions, lambda: None)
