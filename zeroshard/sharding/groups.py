"""Expert-parallel process groups under DeepSpeed's names (`deepspeed.utils.groups`).

World = EP x EDP (DESIGN section 9). Expert-parallel groups are blocks of `ep_size`
consecutive ranks (tokens travel by all-to-all there, so keep them inside a node); expert-
data-parallel groups are strided (the ranks holding the same experts, over which expert
parameters are sharded and their gradients summed). World 4, ep_size 2: EP {0,1} {2,3},
EDP {0,2} {1,3}. Both come from `layout.partition`, the split hybrid sharding uses.

Groups are named `ep_size_<n>` as in DeepSpeed and built once per name, collectively: every
rank must ask for the same names in the same order (every MoE layer of a model is built on
every rank, so that holds).

The getters return a `zeroshard.comm.Group` (global `ranks`, this rank's `rank`, and `handle`,
torch's process group, None for a group of one), which zeroshard's collectives and the gating
functions' `ep_group` take. Code that passes the group to torch.distributed itself should pass
`.handle`.

Sequence-parallel accessors live in `sequence_groups` and are re-exported here, as DeepSpeed
keeps every dimension's getters in this one module.
"""

from __future__ import annotations

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.sharding.sequence_groups import (  # noqa: F401  (DeepSpeed's names, re-exported)
    _get_sequence_data_parallel_group,
    _get_sequence_data_parallel_rank,
    _get_sequence_data_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
    set_sequence_parallel_mpu,
)

_EXPERT_PARALLEL_GROUP: dict[str, Group] = {}
_EXPERT_DATA_PARALLEL_GROUP: dict[str, Group] = {}


def expert_group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def check_ep_size(ep_size: int, world_size: int) -> None:
    """Refuse an expert-parallel size the world cannot be cut into."""
    if not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size}: must be a positive divisor of the world size {world_size} "
            "(world = expert-parallel x expert-data-parallel ranks). Pick an ep_size that divides "
            "the number of ranks."
        )


def _create_expert_and_data_parallel(expert_parallel_size_: int, **_ignored) -> None:
    """Build the `ep_size_<n>` expert-parallel and expert-data-parallel groups (once)."""
    from zeroshard.sharding.layout import partition

    name = expert_group_name(expert_parallel_size_)
    if name in _EXPERT_PARALLEL_GROUP and all(
        _alive(table[name]) for table in (_EXPERT_PARALLEL_GROUP, _EXPERT_DATA_PARALLEL_GROUP)
    ):
        return
    world = comm.world_group()
    check_ep_size(expert_parallel_size_, world.size)
    ep, edp = partition(world, expert_parallel_size_)
    _EXPERT_PARALLEL_GROUP[name] = ep
    _EXPERT_DATA_PARALLEL_GROUP[name] = edp


def _alive(group: Group) -> bool:
    """False once torch's process group behind `group` was destroyed (a new process group
    was initialised since: the groups are built again)."""
    return group.handle_ref is None or group.handle_ref() is not None


def _require(table: dict[str, Group], group_name: str, what: str) -> Group:
    if group_name not in table:
        raise RuntimeError(
            f"{what} group {group_name!r} does not exist yet: it is built when an MoE layer with that "
            "ep_size runs its first forward, by zeroshard.initialize, or by "
            "zeroshard.utils.groups._create_expert_and_data_parallel(ep_size)."
        )
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Group:
    """This rank's expert-parallel group (consecutive ranks; the all-to-all)."""
    return _require(_EXPERT_PARALLEL_GROUP, group_name, "expert parallel")


def _get_expert_data_parallel_group(group_name: str) -> Group:
    """This rank's expert-data-parallel group (strided ranks holding the same experts)."""
    return _require(_EXPERT_DATA_PARALLEL_GROUP, group_name, "expert data parallel")


def _get_expert_parallel_group_dict() -> dict[str, Group]:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group_dict() -> dict[str, Group]:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_group_ranks(group_name: str) -> tuple[int, ...]:
    return _get_expert_parallel_group(group_name).ranks


def _get_expert_data_parallel_group_ranks(group_name: str) -> tuple[int, ...]:
    return _get_expert_data_parallel_group(group_name).ranks


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _get_expert_parallel_group(group_name).size


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _get_expert_data_parallel_group(group_name).size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _get_expert_parallel_group(group_name).rank


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _get_expert_data_parallel_group(group_name).rank


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """The global rank of group rank 0 of this rank's expert-parallel group."""
    return _get_expert_parallel_group(group_name).ranks[0]


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of group rank 0 of this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_group(group_name).ranks[0]


def _get_max_expert_size() -> int | None:
    """The largest ep_size among the groups built so far."""
    sizes = [int(name.rsplit("_", 1)[1]) for name in _EXPERT_PARALLEL_GROUP]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return expert_group_name(_get_max_expert_size())


def _get_max_expert_parallel_group() -> Group:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_data_parallel_group() -> Group:
    """Every rank (dense parameters' data-parallel group)."""
    return comm.world_group()


def _get_data_parallel_world_size() -> int:
    return comm.world_size()


def _get_data_parallel_rank() -> int:
    return comm.rank()
