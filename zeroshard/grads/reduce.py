"""Bucketed reduction of local gradients across ranks: one collective per bucket.

The one reduction every stage uses. Each flat buffer's local gradient is divided by
world_size x k (docs/design.md section 4's gradient semantics), copied into a bucket in the wire
dtype, and when the bucket is full (`reduce_bucket_size` elements, as in DeepSpeed) or the
backward ends, the whole bucket is reduced by one collective: an all-reduce at stages 0-1, a
reduce-scatter at stages 2-3, over the flats' shard group; with hybrid sharding the result is
then all-reduced over their replica group, so it sums over every rank. The results are then
written (in the accumulation dtype) into each flat's reduced gradient. Stage 1 all-reduces as
stage 0 does (zeroshard/sharding/stages.py): its full local buffer becomes the whole reduced gradient,
and the optimizer reads this rank's shard of it.

[Note: why buckets span units]
A unit is often small (one transformer block); one collective per unit pays the
collective's fixed cost once per unit. On gloo, seven asynchronous all-reduces of 1/7 of a
1.24 M-element buffer took 2.1x as long as one all-reduce of the whole buffer
(benchmarks/collectives.py). Filling a bucket across units, in the fixed reduce order, keeps
the count of collectives at ceil(gradient elements / reduce_bucket_size) per backward.

Memory stays bounded by the bucket, not by the model: a flat's gradient is copied into the
bucket when its unit is ready, after which stages 2-3 free the flat's local buffer at once;
a bucket holds at most `reduce_bucket_size` elements (fewer when less remains to be reduced),
and at most two exist at once: one being filled and one being reduced. Issuing a bucket
first completes any older one still in flight (double buffering, as DeepSpeed's overlap_comm
does). Stages 0-1 keep their full local buffer and receive the all-reduced result back into
it (it becomes the reduced gradient), so they hold one full gradient buffer, as before.

[Note: bucket layout]
With a shard group of S ranks (the world, unless hybrid sharding splits it: zeroshard/sharding/layout.py),
a flat's local gradient is viewed as a (S, padded / S) matrix (row r is group rank r's shard).
A bucket is a (S, C) matrix whose column blocks are pieces of flats, so a
reduce-scatter of the bucket (rank-major, i.e. row by row) leaves rank r the r-th row:
exactly its shard of every piece. The all-reduce of stages 0-1 uses the same layout although
any would do: each element then sits at the same place in the same-sized buffer at every stage,
so a backend whose summation order depends on the position (gloo's ring on 3+ ranks) sums
it in the same order, and stages stay bitwise equal.

[Note: the default bucket size per backend]
When the config does not set `reduce_bucket_size` (`default_bucket_numel`), gloo keeps
DeepSpeed's 5e8 elements: there one collective per bucket beats one per unit (the note above).
NCCL's collectives run beside compute, so a large bucket only delays them: with 5e8 a 1B
model's whole gradient (2 GB in fp32) went on the wire after the last unit, fully exposed.
On NCCL the default is the largest flat's size, so each unit's gradient goes on the wire as
soon as the unit is ready, as FSDP2 does.

[Note: reducing straight from the local gradient]
A flat that alone fills a bucket, arriving when no bucket of its kind is being filled, skips
the staging copy: its local gradient is divided in place and is itself the collective's input
(the same division, the same element positions, so bitwise the same result). Only where the
local buffer is not reused before the collective completes: stages 2-3 (it is freed; the
bucket keeps it alive until then) or stages 0-1 when the local buffer becomes the reduced
gradient anyway (in place). A wire dtype other than the accumulation dtype needs the cast
copy, so it is staged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zeroshard.comm import collectives as comm
from zeroshard.comm import faults
from zeroshard.monitor.timers import timed
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.layout import ShardingSpec
from zeroshard.sharding.streams import COMPUTE, NULL_STREAMS, REDUCE, StreamSet

GLOO_BUCKET_NUMEL = 500_000_000  # DeepSpeed's reduce_bucket_size default


def default_bucket_numel(backend: str, flats: list[FlatParamGroup]) -> int:
    """`reduce_bucket_size` when the config does not set it (see the note above): the largest
    flat on NCCL, DeepSpeed's 5e8 elsewhere."""
    if "nccl" in backend and flats:
        return max(flat.padded_numel for flat in flats)
    return GLOO_BUCKET_NUMEL


@dataclass
class _Piece:
    """Columns [c0, c1) of one flat's (rows, columns) view, at `offset` in its bucket."""

    flat: FlatParamGroup
    c0: int
    c1: int
    offset: int
    in_place: bool  # the result goes back into the flat's own local buffer


@dataclass
class _Bucket:
    staging: torch.Tensor  # (rows, capacity) in the wire dtype
    pieces: list[_Piece] = field(default_factory=list)
    used: int = 0  # columns filled
    work: object = None  # the collective's handle once issued
    result: torch.Tensor | None = None  # what the collective writes: (rows or 1, used)
    spec: ShardingSpec | None = None  # the groups the bucket is reduced over
    label: str = ""  # names the bucket in the streams' events

    @property
    def capacity(self) -> int:
        return self.staging.shape[1]


class GradientReducer:
    """Collects flats' local gradients into buckets and reduces each bucket with one collective.

    Every rank must `add` the same flats in the same order (the buckets are collectives);
    `finish` reduces what is left, waits for every collective and writes the results.

    Args:
        flats: every flat the engine owns (the bucket sizes are bounded by what they hold).
        divisor: returns world_size x gradient_accumulation_steps (read at each `add`).
        bucket_numel: the most elements one bucket (one collective) holds.
        landing: offload (zeroshard/sharding/offload.py): told of each piece of a reduced
            shard once it is written, so the shard moves to the host bucket by bucket instead
            of at the step. None without offload.
        streams: the collectives run on a reduce stream on CUDA; no-ops elsewhere. See
            [Note: streams and events] in zeroshard/sharding/streams.py.
    """

    # Whether every synced backward reduces whatever the stage (the deterministic reduction,
    # tree_reduce.py); otherwise the stage's policy says (stages 2-3 do, stages 0-1 at the boundary).
    reduces_every_backward = False

    def __init__(
        self,
        flats: list[FlatParamGroup],
        divisor: Callable[[], int],
        bucket_numel: int,
        landing: Callable[[FlatParamGroup, int, int], None] | None = None,
        streams: StreamSet = NULL_STREAMS,
    ) -> None:
        self._divisor = divisor
        self.bucket_numel = max(1, bucket_numel)
        self._total_cols: dict[tuple, int] = {}
        self._devices: dict[tuple, torch.device] = {}
        self._specs: dict[tuple, ShardingSpec] = {}
        for flat in flats:
            key = self._key(flat)
            self._total_cols[key] = self._total_cols.get(key, 0) + self._cols(flat)
            self._devices[key] = flat.device
            self._specs[key] = flat.spec
        self._added_cols: dict[tuple, int] = {}
        self._open: dict[tuple, _Bucket] = {}  # the bucket being filled, per key
        self._issued: list[_Bucket] = []  # collectives in flight, in issue order (at most one)
        # The sum of this rank's own gradients since the last step: only whether it is
        # finite is used, to name the rank a non-finite gradient came from (zeroshard/step/optimizer_step.py).
        self._local_sum: torch.Tensor | None = None
        self.landing = landing
        self.streams = streams
        self._issued_count = 0  # names buckets in the streams' events

    # ----------------------------------------------------------------- layout
    @staticmethod
    def _key(flat: FlatParamGroup) -> tuple:
        # Flats that can share a collective: same kind of reduction, the same dtypes, the same groups.
        spec = flat.spec
        return (
            flat.policy.scatter, flat.role.grad_accum_dtype, flat.role.reduce_dtype,
            spec.shard.ranks, spec.replicate.ranks,
        )

    @staticmethod
    def _cols(flat: FlatParamGroup) -> int:
        return flat.padded_numel // flat.shard_size

    # ------------------------------------------------------------------- add
    def add(self, flat: FlatParamGroup) -> None:
        """Queue `flat`'s local gradient (zeros if it has none) for reduction."""
        with faults.in_unit(flat.unit_name), faults.in_phase("reduction"):
            self._add(flat)

    def _add(self, flat: FlatParamGroup) -> None:
        key = self._key(flat)
        rows, cols = flat.shard_size, self._cols(flat)
        acc_dtype, wire_dtype = flat.role.grad_accum_dtype, flat.role.reduce_dtype
        # In place (stages 0-1, nothing reduced waiting): the local buffer is already the
        # reduced gradient (the all-reduce writes back into it), so no second gradient buffer
        # exists. It is adopted before staging: issuing a full bucket below may complete an
        # earlier piece of this very flat, whose result then lands in it; it only writes
        # columns already staged. Otherwise (stages 2-3) the local buffer is freed below.
        local, in_place = self._take_local(flat)
        self._note_local(local)
        matrix = local.view(rows, cols)
        divisor = self._divisor()
        if self._reduce_directly(key, flat, in_place, wire_dtype == acc_dtype):
            local.div_(divisor)  # what the staging path's torch.div(..., out=) computes
            bucket = self._open[key] = _Bucket(matrix, [_Piece(flat, 0, cols, 0, in_place)], cols)
            self._added_cols[key] = self._added_cols.get(key, 0) + cols
            self._issue(key)
            if not in_place:
                flat.grads.end_reduction()  # stages 2-3: dropped by the flat, kept alive by the bucket
            return
        c0 = 0
        while c0 < cols:
            bucket = self._open.get(key)
            if bucket is None:
                bucket = self._open[key] = self._new_bucket(key, rows, wire_dtype)
            n = min(bucket.capacity - bucket.used, cols - c0)
            source = matrix[:, c0 : c0 + n]
            target = bucket.staging[:, bucket.used : bucket.used + n]
            if wire_dtype == acc_dtype:
                torch.div(source, divisor, out=target)
            else:
                # Divide in the accumulation dtype first, then narrow: bitwise what a
                # reference dividing before the cast computes. The local values are consumed.
                target.copy_(source.div_(divisor))
            bucket.pieces.append(_Piece(flat, c0, c0 + n, bucket.used, in_place))
            bucket.used += n
            self._added_cols[key] = self._added_cols.get(key, 0) + n
            c0 += n
            if bucket.used == bucket.capacity:
                self._issue(key)
        if not in_place:
            flat.grads.end_reduction()  # every piece was copied into a bucket above

    def _take_local(self, flat: FlatParamGroup) -> tuple[torch.Tensor, bool]:
        """`flat`'s local gradient and whether the reduction writes back into it (buffers.py)."""
        return flat.grads.begin_reduction()

    def drop_accumulated(self) -> None:
        """zero_grad(): forget partial sums held between backward calls (none here)."""

    def _reduce_directly(self, key: tuple, flat: FlatParamGroup, in_place: bool, same_dtype: bool) -> bool:
        """Whether `flat`'s local gradient can be the collective's input itself (the note above)."""
        safe = in_place or flat.policy.reduce_every_backward
        return safe and same_dtype and key not in self._open and flat.padded_numel >= self.bucket_numel

    def _note_local(self, local: torch.Tensor) -> None:
        # NaN and inf survive a sum (inf + -inf is NaN), so one fp32 sum per flat tells
        # whether this rank's own gradient was finite; it stays on the device (no sync).
        total = torch.sum(local, dtype=torch.float32)
        self._local_sum = total if self._local_sum is None else self._local_sum + total

    def take_local_sum(self) -> torch.Tensor | None:
        """The sum of the local gradients reduced since the last call (None if none)."""
        total, self._local_sum = self._local_sum, None
        return total

    def _new_bucket(self, key: tuple, rows: int, wire_dtype: torch.dtype) -> _Bucket:
        remaining = self._total_cols[key] - self._added_cols.get(key, 0)
        # Late gradients can reduce a flat twice in one backward: never size below one column.
        capacity = min(max(1, self.bucket_numel // rows), max(1, remaining))
        staging = torch.empty(rows, capacity, dtype=wire_dtype, device=self._devices[key])
        return _Bucket(staging)

    # --------------------------------------------------------------- reduce
    def _issue(self, key: tuple) -> None:
        # Double buffering: complete what is in flight before the next collective starts, so
        # a model larger than a bucket never holds more than two buckets.
        self._complete_issued()
        bucket = self._open.pop(key)
        scatter = key[0]
        bucket.spec = spec = self._specs[key]
        data = bucket.staging[:, : bucket.used]
        if bucket.used < bucket.capacity:
            data = data.contiguous()  # rank-major rows for the reduce-scatter
        # Every buffer the collective touches is allocated on the compute stream, the reduce
        # stream starts once the staged gradient (its producer) is written, and the buffers
        # live until compute waits on the reduction (`_complete_issued`).
        out = torch.empty(bucket.used, dtype=data.dtype, device=data.device) if scatter else None
        self._issued_count += 1
        bucket.label = f"bucket-{self._issued_count}"
        streams = self.streams
        produced = streams.record(COMPUTE, f"produced:{bucket.label}")
        with streams.on(REDUCE):
            streams.wait(REDUCE, produced)
            if scatter:
                bucket.work = comm.reduce_scatter(out, data.view(-1), group=spec.shard, tag="grad", async_op=True)
                bucket.result = out.view(1, -1)  # this rank's row
            else:
                bucket.work = comm.all_reduce(data, group=spec.shard, tag="grad", async_op=True)
                bucket.result = data  # every row
        self._issued.append(bucket)

    def finish(self) -> None:
        """Reduce every open bucket, wait for every collective, write every result."""
        with timed("bwd_allreduce"), faults.in_phase("reduction"):  # timed: wall_clock_breakdown (monitor/timers.py)
            for key in list(self._open):
                self._issue(key)
            self._complete_issued()
        self._added_cols.clear()

    def _complete_issued(self) -> None:
        issued, self._issued = self._issued, []
        streams = self.streams
        for bucket in issued:
            with streams.on(REDUCE):
                if bucket.work is not None:
                    bucket.work.wait()
                if bucket.spec.replication > 1:
                    # Hybrid sharding: the shard group's sum, summed again over the replicas.
                    comm.all_reduce(bucket.result, group=bucket.spec.replicate, tag="grad")
                reduced = streams.record(REDUCE, f"reduced:{bucket.label}")
            # The results are written (and then stepped on) on the compute stream.
            streams.wait(COMPUTE, reduced)
            for piece in bucket.pieces:
                self._complete(piece, bucket.result[:, piece.offset : piece.offset + piece.c1 - piece.c0])

    def _complete(self, piece: _Piece, result: torch.Tensor) -> None:
        # The reduced gradient is this rank's shard after a reduce-scatter (result: one row,
        # columns c0:c1 of the shard), the whole buffer after an all-reduce (result: every
        # row, columns c0:c1 of the flat's (W, columns) view).
        flat = piece.flat
        if flat.policy.scatter:
            reduced = flat.grads.reduced_buffer()
            result = result[0]
        else:
            reduced = flat.grads.reduced_full_buffer().view(flat.shard_size, -1)
        target = reduced[..., piece.c0 : piece.c1]
        if piece.in_place:
            target.copy_(result)  # the reduced gradient is (part of) the local buffer: adopted in `add`
        else:
            target.add_(result)
        if self.landing is not None and flat.policy.shard_optimizer:
            # Columns c0:c1 of this rank's row are elements c0:c1 of its master's range (the
            # shard a reduce-scatter leaves, or stage 1's row of the all-reduced buffer).
            self.landing(flat, piece.c0, piece.c1)
