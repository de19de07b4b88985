"""After an optimizer step: make the module parameters equal the new master values.

Stages 0 and 3 need no communication (stage 0's master is the whole buffer; stage 3 keeps
parameters sharded). At stages 1-2 every rank needs the whole updated buffer, so each rank's
master shard is all-gathered in the parameter dtype. Shards of several flats share one
all-gather, up to `allgather_bucket_size` elements (as in DeepSpeed): one collective per
flat paid the collective's fixed cost once per flat (see zeroshard/grad_reduce.py's note on
buckets; benchmarks/collectives.py measures it). All buckets are issued asynchronously and
then completed in order.

[Note: gather bucket layout]
A bucket is a (W, C) matrix in the parameter dtype whose column blocks are pieces of flats:
rank r contributes row r (its shards, side by side) and the all-gather returns every row. A
flat's full buffer viewed as (W, shard_numel) is exactly those rows, so each piece is copied
back with one strided copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm
from .flat import FlatParamGroup


@dataclass
class _GatherPiece:
    flat: FlatParamGroup
    c0: int  # columns [c0, c1) of the flat's (W, shard_numel) view
    c1: int
    offset: int  # first column in the bucket


def publish_masters(flats: list[FlatParamGroup], bucket_numel: int) -> None:
    """Write every flat's updated master into its module parameters (a collective at stages
    1-2: every rank must call it with the same flats in the same order)."""
    gathered: dict[tuple, list[FlatParamGroup]] = {}
    for flat in flats:
        if flat.needs_gather_to_publish():
            gathered.setdefault((flat.role.param_dtype, flat.spec.shard.ranks), []).append(flat)
        else:
            flat.publish_master()
    in_flight = []
    for (dtype, _), group in gathered.items():
        for pieces, columns in _plan_buckets(group, bucket_numel):
            in_flight.append(_start_bucket(pieces, columns, dtype))
    for work, output, pieces in in_flight:
        if work is not None:
            work.wait()
        with torch.no_grad():
            for piece in pieces:
                n = piece.c1 - piece.c0
                full = piece.flat.full.view(piece.flat.shard_size, -1)
                full[:, piece.c0 : piece.c1].copy_(output[:, piece.offset : piece.offset + n])


def _plan_buckets(flats: list[FlatParamGroup], bucket_numel: int) -> list[tuple[list[_GatherPiece], int]]:
    """Cut the flats' shard columns, in order, into buckets of at most bucket_numel // W columns."""
    world_size = flats[0].shard_size
    capacity = max(1, bucket_numel // world_size)
    buckets: list[tuple[list[_GatherPiece], int]] = []
    pieces: list[_GatherPiece] = []
    used = 0
    for flat in flats:
        c0 = 0
        while c0 < flat.shard_numel:
            n = min(capacity - used, flat.shard_numel - c0)
            pieces.append(_GatherPiece(flat, c0, c0 + n, used))
            used += n
            c0 += n
            if used == capacity:
                buckets.append((pieces, used))
                pieces, used = [], 0
    if pieces:
        buckets.append((pieces, used))
    return buckets


def _start_bucket(pieces: list[_GatherPiece], columns: int, dtype: torch.dtype):
    flat0 = pieces[0].flat
    mine = torch.empty(columns, dtype=dtype, device=flat0.device)
    for piece in pieces:
        # Cast (if the master is wider) while copying: the wire carries the parameter dtype.
        mine[piece.offset : piece.offset + piece.c1 - piece.c0].copy_(piece.flat.master[piece.c0 : piece.c1])
    output = torch.empty(flat0.shard_size, columns, dtype=dtype, device=flat0.device)
    work = comm.all_gather(output, mine, group=flat0.spec.shard, tag="param", async_op=True)
    return work, output, pieces
