"""DeepSpeed's ZeRO API over zeroshard's shards: `zeroshard.zero.GatheredParameters` (here: read or
change full parameters at any stage), `zeroshard.zero.Init` (init.py: build a model already
sharded), the full and local tensor helpers (`safe_get_full_fp32_param` and friends:
full_tensors.py, tensor_fragment.py) and the stage-3 leaf modules (leaf_modules.py).

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

from zeroshard.comm import collectives as comm
from zeroshard.zero.full_tensors import _locate
from zeroshard.zero.init import Init, gather_partitioned, release_partitioned  # noqa: F401  (zeroshard.zero.Init)


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
    params = list(params)
    flats = {}
    registry = None
    for p in params:
        try:
            registry, flat, _ = _locate(p)
        except ValueError:
            continue  # not managed (frozen, or built under Init and not yet given to initialize)
        flats[id(flat)] = flat
    # A model built under zeroshard.zero.Init, before initialize: its parameters are parts.
    unadopted = gather_partitioned(params)
    ordered = [f for f in registry.flats if id(f) in flats] if registry is not None else []
    gathered_here, fp8_before = [], []
    for flat in ordered:
        if flat.params_sharded and flat.state.value != "unsharded":
            # Exactly, in the parameter dtype: the plan's gather dtype is for compute (a flat
            # gathered in fp8 holds placeholders: zeroshard/sharding/fp8_gather.py's note).
            (fp8_before if flat.state.value == "fp8" else gathered_here).append(flat)
            flat.gather_full(tag="gathered_parameters", exact=True)
    before = [flat.full.clone() for flat in ordered] if modifier_rank is not None else []
    try:
        yield
    finally:
        if modifier_rank is not None:
            with torch.no_grad():
                for flat, old in zip(ordered, before, strict=True):
                    # With tensor parallelism a flat of pieces is shared by the tensor-data group
                    # only: the modifier's counterpart there broadcasts (ShardingSpec.source_for).
                    src = flat.spec.source_for(modifier_rank)
                    comm.broadcast(flat.full, group=flat.spec.peers, src=src, tag="gathered_parameters")
                    flat.write_back_full(changed=flat.full.ne(old))
        for flat in gathered_here:
            flat.free_full()
        for flat in fp8_before:
            flat.release_exact()
        release_partitioned(unadopted, modifier_rank)
