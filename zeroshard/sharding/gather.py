"""The one all-gather of shards into full tensors.

Every gather of a sharded tensor goes through `all_gather_shards`: stage 3's parameter gather
and prefetch (flat.py), stages 1-2's publish after the step (publish.py), the full-tensor
helpers and GatheredParameters (zeroshard/zero/full_tensors.py, zeroshard/zero/__init__.py),
the 16-bit export, and Muon's gathers of its update (zeroshard/optim/muon/sharded.py). What differs
between them is an argument:

* `wire_dtype`: what goes on the wire. Training passes the plan's gather dtype (or the
  parameter dtype at publish); None means exact: the target's own dtype, bit for bit (helpers,
  exports, GatheredParameters).
* `bucket_numel`: pieces of several tensors share one collective of at most this many
  elements (stage 1-2 publish: `allgather_bucket_size`, see [Note: gather buckets]); None
  gathers all the pieces in one collective (one piece: the stage-3 per-flat gather).

[Note: gather buckets]
A piece is (source, target): this rank's shard of n elements, and the full tensor of
S x n elements (S the group size) that row r of a (S, n) view of which is rank r's shard.
A bucket is a (S, C) matrix whose column blocks are pieces: rank r contributes row r (its
shards side by side, cast to the wire dtype) and the all-gather returns every row, which is
copied back into each target's (S, n) view with one strided copy. One collective per
tensor paid the collective's fixed cost once per tensor (zeroshard/grads/reduce.py's [Note: why buckets span units];
benchmarks/collectives.py), hence the buckets.

At most `max_in_flight` buckets (two) are in flight: issuing the third waits for the first
and writes it out, so memory stays bounded by two buckets whatever the model size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.monitor.timers import timed

MAX_IN_FLIGHT = 2


@dataclass(frozen=True)
class GatherPiece:
    """Gather `source` (this rank's shard, 1-D) from every group member into `target`
    (1-D, group size x len(source) elements, group-rank-major).

    `in_place`: cast `source` straight into this rank's slot of `target` and gather there,
    with no buffer of its own (stage 3 gathering from a wider master, flat.py's [Note:
    gathering from the master]); only for a piece gathered alone in the target's dtype.
    """

    source: torch.Tensor
    target: torch.Tensor
    in_place: bool = False


@dataclass
class _Slot:
    piece: GatherPiece
    c0: int  # columns [c0, c1) of the piece's (S, n) view
    c1: int
    offset: int  # first column in the bucket


@dataclass
class _Bucket:
    slots: list[_Slot] = field(default_factory=list)
    columns: int = 0
    work: object = None
    output: torch.Tensor | None = None  # (S, columns) in the wire dtype
    direct: bool = False  # the collective wrote straight into the one piece's target


class Gathering:
    """All-gathers in flight; `wait()` completes them and writes every target."""

    def __init__(self, group: Group, wire_dtype: torch.dtype | None, tag: str, max_in_flight: int) -> None:
        self._group, self._wire_dtype, self._tag = group, wire_dtype, tag
        self._max_in_flight = max(1, max_in_flight)
        self._in_flight: list[_Bucket] = []

    def _issue(self, bucket: _Bucket) -> None:
        while len(self._in_flight) >= self._max_in_flight:
            self._complete(self._in_flight.pop(0))
        group = self._group
        first = bucket.slots[0].piece
        wire = self._wire_dtype or first.target.dtype
        if len(bucket.slots) == 1 and bucket.columns == first.source.numel() and first.target.dtype == wire:
            # One whole piece in the target's dtype: gather straight into the target. The
            # source is copied (into a buffer, or in place into this rank's slot of the
            # target) so that a later in-place change of it (an optimizer step on a master
            # that is the shard) cannot race the collective.
            bucket.direct = True
            source = first.source.reshape(-1)
            if first.in_place:
                mine = first.target.narrow(0, group.rank * source.numel(), source.numel())
                mine.copy_(source)  # the cast to the wire dtype, as `.to` below does
            else:
                mine = source.to(device=first.target.device, dtype=wire, copy=True)
            bucket.work = comm.all_gather(first.target, mine, group=group, tag=self._tag, async_op=True)
        else:
            assert not any(slot.piece.in_place for slot in bucket.slots), "an in-place piece is gathered alone"
            # On the target's device: a host source (offload) is packed into a device bucket.
            mine = torch.empty(bucket.columns, dtype=wire, device=first.target.device)
            for slot in bucket.slots:
                # Cast while copying: the wire carries `wire`.
                source = slot.piece.source.reshape(-1)[slot.c0 : slot.c1]
                mine[slot.offset : slot.offset + slot.c1 - slot.c0].copy_(source)
            bucket.output = torch.empty(group.size, bucket.columns, dtype=wire, device=first.target.device)
            bucket.work = comm.all_gather(bucket.output, mine, group=group, tag=self._tag, async_op=True)
        self._in_flight.append(bucket)

    @staticmethod
    def _complete(bucket: _Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
        if bucket.direct:
            return
        with torch.no_grad():
            for slot in bucket.slots:
                n = slot.c1 - slot.c0
                rows = slot.piece.target.view(bucket.output.shape[0], -1)
                rows[:, slot.c0 : slot.c1].copy_(bucket.output[:, slot.offset : slot.offset + n])

    def wait(self) -> None:
        in_flight, self._in_flight = self._in_flight, []
        with timed("gather"):  # wall_clock_breakdown (zeroshard/monitor/timers.py)
            for bucket in in_flight:
                self._complete(bucket)


def all_gather_shards(
    pieces: Sequence[GatherPiece],
    *,
    group: Group,
    tag: str,
    wire_dtype: torch.dtype | None = None,
    bucket_numel: int | None = None,
    max_in_flight: int = MAX_IN_FLIGHT,
) -> Gathering:
    """Start gathering every piece over `group` (a collective: every member passes pieces of
    the same sizes, in the same order). Returns the `Gathering` to `wait()` on; until then the
    targets must not be read.

    Args:
        pieces: what to gather; each target holds group size x len(source) elements.
        group: the group the sources are sharded over (a flat's `spec.shard`).
        tag: the recorder's tag ("param", "full_tensor", "muon", ...).
        wire_dtype: the dtype on the wire; None: exact, each target's own dtype.
        bucket_numel: the most elements one collective gathers (all ranks' rows); None: all
            pieces in one collective.
        max_in_flight: buckets in flight at once (issuing one more completes the oldest).
    """
    gathering = Gathering(group, wire_dtype, tag, max_in_flight)
    capacity = None if bucket_numel is None else max(1, bucket_numel // group.size)
    bucket = _Bucket()
    for piece in pieces:
        n = piece.source.numel()
        assert piece.target.numel() == n * group.size, "all_gather_shards: target is not group size x source"
        c0 = 0
        while c0 < n:
            take = n - c0 if capacity is None else min(capacity - bucket.columns, n - c0)
            bucket.slots.append(_Slot(piece, c0, c0 + take, bucket.columns))
            bucket.columns += take
            c0 += take
            if capacity is not None and bucket.columns == capacity:
                gathering._issue(bucket)
                bucket = _Bucket()
    if bucket.slots:
        gathering._issue(bucket)
    return gathering
