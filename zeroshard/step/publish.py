"""After an optimizer step: make the module parameters equal the new master values.

Stages 0 and 3 need no communication (stage 0's master is the whole buffer; stage 3 keeps
parameters sharded). At stages 1-2 every rank needs the whole updated buffer, so each rank's
master shard is all-gathered over its shard group in the parameter dtype, through the one
gather mechanism (zeroshard/sharding/gather.py): shards of several flats share one all-gather of up to
`allgather_bucket_size` elements (as in DeepSpeed), at most two buckets in flight.
"""

from __future__ import annotations

import torch

from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.gather import GatherPiece, all_gather_shards


def publish_masters(flats: list[FlatParamGroup], bucket_numel: int) -> None:
    """Write every flat's updated master into its module parameters (a collective at stages
    1-2: every rank must call it with the same flats in the same order)."""
    gathered: dict[tuple, list[FlatParamGroup]] = {}
    for flat in flats:
        if flat.needs_gather_to_publish():
            gathered.setdefault((flat.role.param_dtype, flat.spec.shard.ranks), []).append(flat)
        else:
            flat.publish_master()
    for (dtype, _), group in gathered.items():
        pieces = [GatherPiece(flat.master, flat.full) for flat in group]
        with torch.no_grad():
            # The wire carries the parameter dtype: a wider master is cast while packed.
            all_gather_shards(
                pieces, group=group[0].spec.shard, tag="param", wire_dtype=dtype, bucket_numel=bucket_numel
            ).wait()
