"""DeepSpeed's user-facing `deepspeed.comm` functions, under `zeroshard.comm`.

A script written against DeepSpeed calls `dist.get_rank()`, `dist.barrier()`,
`dist.all_reduce(tensor)` with `import deepspeed.comm as dist`; these functions take DeepSpeed
0.19's positional arguments and return what torch.distributed returns (None, or a work handle
with `async_op=True`). They are thin: each forwards to torch.distributed on the group named.

Differences from the engine's own collectives (`zeroshard.comm.collectives`): these accept
`group=None` (the default process group), a torch ProcessGroup or a zeroshard `Group`; they are
not seen by `zeroshard.comm.recording()`, which records what the engine issues.

Without a process group (zeroshard runs a lone process as a world of one, where DeepSpeed
would stop at an assertion) the rank queries answer for that world: rank 0 of 1, and a
collective over the default group leaves its tensors as a world of one would. A zeroshard
`Group` of one member has no torch group (`Group.handle` is None, which torch would read as
the default group), so collectives on it are likewise answered locally.

DeepSpeed's profiling arguments (`prof`, `log_name`, `debug`) are accepted and ignored:
zeroshard has no comms logger.
"""

from __future__ import annotations

import atexit
import enum
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm import compat as _compat
from zeroshard.comm.collectives import Group
from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S

__all__ = [
    "ReduceOp",
    "init_distributed",
    "is_initialized",
    "is_available",
    "destroy_process_group",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_global_rank",
    "get_all_ranks_from_group",
    "barrier",
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
]

# DeepSpeed's default port for MPI discovery (TORCH_DISTRIBUTED_DEFAULT_PORT there), which is
# also zeroshard's launchers' default MASTER_PORT.
_DEFAULT_PORT = 29500


class ReduceOp(enum.Enum):
    """DeepSpeed's reduction names (`deepspeed.comm.ReduceOp`); torch's own
    `torch.distributed.ReduceOp` values are accepted wherever one of these is."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def _torch_op(op: Any) -> Any:
    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise ValueError("ReduceOp.UNUSED names no reduction")
        return getattr(dist.ReduceOp, op.name)
    return op


class _Local:
    """Where a collective runs in this process alone: no process group, or a zeroshard
    `Group` of one member."""


_LOCAL = _Local()


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _target(group: Any) -> Any:
    """torch's group for `group` (None: the default one), or `_LOCAL`."""
    if isinstance(group, Group):
        return _LOCAL if group.size == 1 else group.handle
    if group is None and not _initialized():
        return _LOCAL
    return group


# --- set-up -------------------------------------------------------------------------------


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = _DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Create the default process group, as `deepspeed.comm.init_distributed` does.

    A group that exists already (the user's, or torchrun's through `zeroshard.initialize`) is
    kept. With `init_method`, or an explicit `rank` and `world_size`, torch's
    `init_process_group` gets them as given. Otherwise the launcher's environment is read
    (torchrun's variables; srun's and mpirun's mapped to them unless `auto_mpi_discovery` is
    False, `zeroshard.launch.launchers`), and a lone process stays a world of one.

    `timeout` (a timedelta or seconds): None is zeroshard's collective timeout, 10 minutes
    (DeepSpeed's is 30). `distributed_port` is the MASTER_PORT used where srun's or mpirun's
    variables are mapped and none is set; `verbose` and `config` (DeepSpeed's comms-logger settings) are
    accepted and have no effect.

    Raises:
        RuntimeError: `dist_init_required=False` and no process group exists.
    """
    del verbose, config
    # Imported here: zeroshard.launch imports zeroshard.comm (its fault constants).
    from zeroshard.launch import distributed as launch

    if _initialized():
        return
    if dist_init_required is False:
        raise RuntimeError(
            "init_distributed(dist_init_required=False): no process group exists. Create one "
            "(torch.distributed.init_process_group) first, or pass dist_init_required=None."
        )
    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    explicit = init_method is not None or (rank >= 0 and world_size > 0)
    if not explicit:
        if not auto_mpi_discovery and not launch.launched_by_torchrun():
            return  # only torchrun's variables may start a group; without them a world of one
        if "RANK" not in os.environ and "MASTER_PORT" not in os.environ and distributed_port != _DEFAULT_PORT:
            os.environ["MASTER_PORT"] = str(distributed_port)  # read where mpirun's variables are mapped
        launch.init_distributed(dist_backend, timeout)
        return
    if timeout is None:
        timeout = timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        backend=dist_backend or launch.default_backend(), init_method=init_method, timeout=timeout,
        rank=rank, world_size=world_size,
    )
    # Freed before the interpreter finalizes, as launch.init_distributed's own group is:
    # [Note: process-group lifetime] in zeroshard/launch/distributed.py.
    atexit.register(launch._destroy_if_initialized)


def is_initialized() -> bool:
    """Whether the default process group exists."""
    return _initialized()


def is_available() -> bool:
    """Whether this torch was built with torch.distributed."""
    return dist.is_available()


def destroy_process_group(group: Any = None) -> None:
    """Destroy `group` (None: the default group, and with it every other)."""
    target = _target(group)
    if target is _LOCAL:
        return
    dist.destroy_process_group(target)


def new_group(ranks: list[int]) -> Any:
    """A torch ProcessGroup of the global `ranks`. Collective: every rank of the default
    group calls it with the same ranks, in the same order."""
    return dist.new_group(list(ranks))


# --- who am I -----------------------------------------------------------------------------


def get_rank(group: Any = None) -> int:
    """This process's rank in `group` (None: the default group); -1 if not a member."""
    if isinstance(group, Group):
        return group.rank
    if group is None and not _initialized():
        return 0
    return dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (None: the default group)."""
    if isinstance(group, Group):
        return group.size
    if group is None and not _initialized():
        return 1
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's index on its machine, as its launcher set it (LOCAL_RANK, or srun's and
    mpirun's equivalent); 0 for a process no launcher started."""
    from zeroshard.launch.launchers import launcher_local_rank

    local = launcher_local_rank()
    return 0 if local is None else local


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of the member `group_rank` of `group` (None: the default group)."""
    if isinstance(group, Group):
        return group.ranks[group_rank]
    if group is None and not _initialized():
        if group_rank != 0:
            raise ValueError(f"group_rank={group_rank}: a world of one has only rank 0")
        return 0
    return dist.get_global_rank(group if group is not None else dist.group.WORLD, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of `group`'s members, in group-rank order."""
    if isinstance(group, Group):
        return list(group.ranks)
    if group is None and not _initialized():
        return [0]
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# --- collectives --------------------------------------------------------------------------


def barrier(group: Any = None, async_op: bool = False, device_ids: list[int] | None = None,
            prof: bool = False, log_name: str = "barrier", debug: Any = None) -> Any:
    """Wait until every member of `group` reaches the barrier."""
    target = _target(group)
    if target is _LOCAL:
        return None
    return dist.barrier(group=target, async_op=async_op, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_reduce", debug: Any = None) -> Any:
    """Reduce `tensor` over `group`, in place on every member."""
    target = _target(group)
    if target is _LOCAL:
        return None
    return dist.all_reduce(tensor, op=_torch_op(op), group=target, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False,
              prof: bool = False, log_name: str = "broadcast", debug: Any = None) -> Any:
    """`tensor` of global rank `src` to every member of `group`, in place."""
    target = _target(group)
    if target is _LOCAL:
        return None
    return dist.broadcast(tensor, src, group=target, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False,
               prof: bool = False, log_name: str = "all_gather", debug: Any = None) -> Any:
    """Member i's `tensor` into `tensor_list[i]`, on every member."""
    target = _target(group)
    if target is _LOCAL:
        tensor_list[0].copy_(tensor)
        return None
    return dist.all_gather(tensor_list, tensor, group=target, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False, prof: bool = False, log_name: str = "all_gather_into_tensor",
                           debug: Any = None) -> Any:
    """Every member's `tensor`, concatenated in group-rank order, into `output_tensor`."""
    target = _target(group)
    if target is _LOCAL:
        output_tensor.view(-1).copy_(tensor.view(-1))
        return None
    return _compat.all_gather_single(output_tensor, tensor, group=target, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False, prof: bool = False,
                          log_name: str = "reduce_scatter_tensor", debug: Any = None) -> Any:
    """Reduce `tensor` (group size x len(output_tensor) elements) over `group`; member i keeps
    chunk i in `output_tensor`."""
    target = _target(group)
    if target is _LOCAL:
        output_tensor.view(-1).copy_(tensor.view(-1))
        return None
    return _compat.reduce_scatter_single(output_tensor, tensor, op=_torch_op(op), group=target, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, async_op: bool = False,
                      prof: bool = False, log_name: str = "all_to_all_single", debug: Any = None) -> Any:
    """Slice i of `tensor` (along dim 0) to member i; slice j of `output` from member j."""
    target = _target(group)
    if target is _LOCAL:
        output.copy_(tensor)
        return None
    return dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group=target,
                                  async_op=async_op)
