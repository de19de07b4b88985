"""`zeroshard.comm`: DeepSpeed's `deepspeed.comm` path.

The user-facing functions are DeepSpeed's (`get_rank()`, `barrier()`, `all_reduce(tensor)`,
...: `zeroshard.comm.deepspeed_api`). Where one of DeepSpeed's names is also the name of one
of the engine's own collectives (all_reduce, broadcast, all_gather, all_to_all_single,
new_group, and DeepSpeed's reduce_scatter and all_gather_object), this package means
DeepSpeed's; the engine's live in `zeroshard.comm.collectives` (keyword-only `group=`, each
recorded), which zeroshard's modules import as `from zeroshard.comm import collectives as comm`.

Also here: the collective recorder (`recording()`, `CollectiveLog`, `CollectiveRecord`) and
zeroshard's process-group names (`Group`, `world_group()`, ...)."""

from zeroshard.comm.collectives import (
    CollectiveLog,
    CollectiveRecord,
    Group,
    as_group,
    backend_name,
    group_of,
    rank,
    recording,
    self_group,
    set_timeout,
    world_group,
    world_size,
)
from zeroshard.comm.deepspeed_api import *  # noqa: F401,F403
from zeroshard.comm.deepspeed_api import __all__ as _deepspeed_all

__all__ = [
    "CollectiveLog",
    "CollectiveRecord",
    "Group",
    "as_group",
    "backend_name",
    "group_of",
    "rank",
    "recording",
    "self_group",
    "set_timeout",
    "world_group",
    "world_size",
    *_deepspeed_all,
]
