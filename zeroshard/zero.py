"""`zeroshard.zero.GatheredParameters`: read or change full parameters at any stage.

At stage 3 a unit's parameters exist only around its forward and backward; inside this
context they are gathered. With `modifier_rank=r`, changes rank r makes to the full
parameters inside the block are broadcast to every rank and written back into the shards
and the master weights on exit, as DeepSpeed's context of the same name does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from . import comm
from .full_tensors import _locate


@contextlib.contextmanager
def GatheredParameters(
    params: nn.Parameter | Iterable[nn.Parameter],
    modifier_rank: int | None = None,
    fwd_module: nn.Module | None = None,
    enabled: bool = True,
) -> Iterator[None]:
    if not enabled:
        yield
        return
    if isinstance(params, torch.Tensor):
        params = [params]
    flats = {}
    engine = None
    for p in params:
        try:
            engine, flat, _ = _locate(p)
        except ValueError:
            continue  # not managed (frozen): it is always whole on every rank
        flats[id(flat)] = flat
    ordered = [f for f in engine.flats if id(f) in flats] if engine is not None else []
    gathered_here = []
    for flat in ordered:
        if flat.param_shard is not None and flat.state.value == "sharded":
            flat.gather_full(tag="gathered_parameters")
            gathered_here.append(flat)
    try:
        yield
    finally:
        if modifier_rank is not None:
            with torch.no_grad():
                for flat in ordered:
                    comm.broadcast(flat.full, src=modifier_rank, tag="gathered_parameters")
                    _write_back(flat)
        for flat in gathered_here:
            flat.free_full()


def _write_back(flat) -> None:
    """Make the shard and the master agree with the (modified) full parameters."""
    source = flat.full if not flat.policy.shard_optimizer else flat.shard_of(flat.full)
    if flat.param_shard is not None:
        flat.param_shard.copy_(flat.shard_of(flat.full))
    if flat.master is not source and flat.master is not flat.param_shard:
        flat.master.copy_(source)
