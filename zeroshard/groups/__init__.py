"""DeepSpeed's `deepspeed.utils.groups`: the getters of every parallel dimension's process
groups, as read-only views onto the process's `ParallelLayout` (zeroshard/sharding/layout.py,
the only place that computes ranks; it holds every group and states the placement:
expert-parallel groups consecutive, expert-data-parallel strided). DeepSpeed keeps every
dimension's getters in one module: the expert and data-parallel ones are here, the
sequence-parallel ones in sequence.py and the tensor-parallel ones in tensor.py, re-exported
here. `zeroshard.utils.groups` is DeepSpeed's
import path to the same functions.

Expert groups are named `ep_size_<n>` as in DeepSpeed and built once per name, collectively,
by `_create_expert_and_data_parallel` (or an MoE layer, or `initialize`): every rank must ask
for the same names in the same order (every MoE layer of a model is built on every rank).

The getters return a `zeroshard.comm.Group` (global `ranks`, this rank's `rank`, and `handle`,
torch's process group, None for a group of one), which zeroshard's collectives and the gating
functions' `ep_group` take. Code that passes the group to torch.distributed itself should pass
`.handle`.
"""

from __future__ import annotations

from types import MappingProxyType

from zeroshard.comm.collectives import Group
from zeroshard.groups.sequence import (  # noqa: F401  (DeepSpeed's names, re-exported)
    _get_sequence_data_parallel_group,
    _get_sequence_data_parallel_rank,
    _get_sequence_data_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
    set_sequence_parallel_mpu,
)
from zeroshard.groups.tensor import *  # noqa: F403  (DeepSpeed's tensor-parallel getters, tensor.py)
from zeroshard.groups.tensor import __all__ as _tensor_names
from zeroshard.sharding.layout import (  # noqa: F401  (check_ep_size: DeepSpeed-path callers import it here)
    check_ep_size,
    current_layout,
    expert_group_name,
)


def _create_expert_and_data_parallel(expert_parallel_size_: int, **_ignored) -> None:
    """Build the `ep_size_<n>` expert-parallel and expert-data-parallel groups (once)."""
    current_layout().expert_groups(expert_parallel_size_)


def _require(table: MappingProxyType, group_name: str, what: str) -> Group:
    if group_name not in table:
        raise RuntimeError(
            f"{what} group {group_name!r} does not exist yet: it is built when an MoE layer with that "
            "ep_size runs its first forward, by zeroshard.initialize, or by "
            "zeroshard.utils.groups._create_expert_and_data_parallel(ep_size)."
        )
    return table[group_name]


def _get_expert_parallel_group(group_name: str) -> Group:
    """This rank's expert-parallel group (consecutive ranks; the all-to-all)."""
    return _require(_get_expert_parallel_group_dict(), group_name, "expert parallel")


def _get_expert_data_parallel_group(group_name: str) -> Group:
    """This rank's expert-data-parallel group (strided ranks holding the same experts)."""
    return _require(_get_expert_data_parallel_group_dict(), group_name, "expert data parallel")


def _get_expert_parallel_group_dict() -> MappingProxyType:
    """Expert group name -> this rank's expert-parallel group (read-only)."""
    return current_layout().expert_parallel_view()


def _get_expert_data_parallel_group_dict() -> MappingProxyType:
    """Expert group name -> this rank's expert-data-parallel group (read-only)."""
    return current_layout().expert_data_parallel_view()


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
    sizes = [int(name.rsplit("_", 1)[1]) for name in _get_expert_parallel_group_dict()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return expert_group_name(_get_max_expert_size())


def _get_max_expert_parallel_group() -> Group:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_data_parallel_group() -> Group:
    """Every rank (dense parameters' data-parallel group)."""
    return current_layout().world


def _get_data_parallel_world_size() -> int:
    return current_layout().world.size


def _get_data_parallel_rank() -> int:
    return current_layout().world.rank


__all__ = [
    "_create_expert_and_data_parallel",
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_parallel_world_size",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "check_ep_size",
    "expert_group_name",
    "set_sequence_parallel_mpu",
    *_tensor_names,
]
