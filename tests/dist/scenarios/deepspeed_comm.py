"""Rank-side scenarios for tests/dist/comm/test_deepspeed_comm.py: DeepSpeed's `deepspeed.comm`
calls through `zeroshard.comm`, each next to the same call made on torch.distributed itself."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard.comm as ds_comm
from zeroshard.comm import collectives


def _value(rank: int, n: int = 6) -> torch.Tensor:
    # Distinct per rank and per element, exact in fp32: sums and products compare exactly.
    return torch.arange(n, dtype=torch.float32) + 10.0 * (rank + 1)


def queries() -> dict[str, Any]:
    """Rank and size queries on the default group, a torch subgroup and a zeroshard Group."""
    world = dist.get_world_size()
    sub = dist.new_group([world - 1])  # every rank creates it (torch's rule); only the last is a member
    mine = ds_comm.new_group(list(range(world)))
    zs_world = collectives.world_group()
    return {
        "is_initialized": ds_comm.is_initialized(),
        "is_available": ds_comm.is_available(),
        "rank": (ds_comm.get_rank(), dist.get_rank()),
        "world_size": (ds_comm.get_world_size(), dist.get_world_size()),
        "rank_in_sub": (ds_comm.get_rank(sub), dist.get_rank(sub)),
        "rank_in_new_group": (ds_comm.get_rank(mine), dist.get_rank(mine)),
        "rank_in_zs_group": (ds_comm.get_rank(zs_world), dist.get_rank()),
        "size_of_zs_group": (ds_comm.get_world_size(zs_world), dist.get_world_size()),
        "global_rank_1": (ds_comm.get_global_rank(None, 1), dist.get_global_rank(dist.group.WORLD, 1)),
        "global_rank_zs": (ds_comm.get_global_rank(zs_world, 1), dist.get_global_rank(dist.group.WORLD, 1)),
        "all_ranks": (ds_comm.get_all_ranks_from_group(), dist.get_process_group_ranks(dist.group.WORLD)),
        "all_ranks_zs": (ds_comm.get_all_ranks_from_group(zs_world), dist.get_process_group_ranks(dist.group.WORLD)),
        "local_rank": ds_comm.get_local_rank(),
    }


def collectives_against_torch() -> dict[str, Any]:
    """Each collective through zeroshard.comm (DeepSpeed's positional arguments) and through
    torch.distributed on copies of the same inputs; both results per call."""
    rank, world = dist.get_rank(), dist.get_world_size()
    zs_world = collectives.world_group()
    out: dict[str, Any] = {}

    for name, op, torch_op in (("sum", ds_comm.ReduceOp.SUM, dist.ReduceOp.SUM),
                               ("max", ds_comm.ReduceOp.MAX, dist.ReduceOp.MAX),
                               ("product", ds_comm.ReduceOp.PRODUCT, dist.ReduceOp.PRODUCT)):
        ours, theirs = _value(rank), _value(rank)
        ds_comm.all_reduce(ours, op)
        dist.all_reduce(theirs, torch_op)
        out[f"all_reduce_{name}"] = (ours, theirs)
    ours, theirs = _value(rank), _value(rank)
    ds_comm.all_reduce(ours, dist.ReduceOp.MIN, zs_world)  # torch's op and a zeroshard Group
    dist.all_reduce(theirs, dist.ReduceOp.MIN)
    out["all_reduce_min_zs_group"] = (ours, theirs)
    ours, theirs = _value(rank), _value(rank)
    ds_comm.all_reduce(ours, group=None, async_op=True).wait()
    dist.all_reduce(theirs)
    out["all_reduce_async"] = (ours, theirs)

    ours, theirs = _value(rank), _value(rank)
    ds_comm.broadcast(ours, world - 1)
    dist.broadcast(theirs, world - 1)
    out["broadcast"] = (ours, theirs)

    ours = [torch.empty(6) for _ in range(world)]
    theirs = [torch.empty(6) for _ in range(world)]
    ds_comm.all_gather(ours, _value(rank))
    dist.all_gather(theirs, _value(rank))
    out["all_gather"] = (torch.stack(ours), torch.stack(theirs))

    ours, theirs = torch.empty(6 * world), torch.empty(6 * world)
    ds_comm.all_gather_into_tensor(ours, _value(rank), zs_world)
    dist.all_gather(list(theirs.chunk(world)), _value(rank))
    out["all_gather_into_tensor"] = (ours, theirs)

    ours, theirs = torch.empty(3), torch.empty(3)
    ds_comm.reduce_scatter_tensor(ours, _value(rank, 3 * world))
    full = _value(rank, 3 * world)
    dist.all_reduce(full)
    theirs.copy_(full.chunk(world)[rank])
    out["reduce_scatter_tensor"] = (ours, theirs)

    send = _value(rank, 2 * world)
    ours, theirs = torch.empty(2 * world), torch.empty(2 * world)
    ds_comm.all_to_all_single(ours, send)
    dist.all_to_all_single(theirs, send.clone())
    out["all_to_all_single"] = (ours, theirs)

    # Uneven splits: rank r sends j + 1 elements to rank j.
    send = torch.cat([torch.full((j + 1,), float(10 * rank + j)) for j in range(world)])
    ours, theirs = torch.empty((rank + 1) * world), torch.empty((rank + 1) * world)
    splits_out, splits_in = [rank + 1] * world, [j + 1 for j in range(world)]
    ds_comm.all_to_all_single(ours, send, splits_out, splits_in)
    dist.all_to_all_single(theirs, send.clone(), splits_out, splits_in)
    out["all_to_all_single_uneven"] = (ours, theirs)

    ds_comm.barrier()
    ds_comm.barrier(zs_world)
    with collectives.recording() as log:
        ds_comm.all_reduce(_value(rank))
    out["recorded"] = len(log.records)
    return out


def init_distributed_keeps_the_group() -> bool:
    """`init_distributed` with a group already there (torchrun's, here the pool's) keeps it."""
    before = dist.group.WORLD
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=None)
    ds_comm.init_distributed(dist_init_required=False)
    return dist.group.WORLD is before and ds_comm.is_initialized()
