"""Parameters partitioned by `zeroshard.zero.Init`: each rank keeps only its part.

A partitioned parameter reads as empty (a 0-element tensor of its dtype, as stage-3
parameters do between gathers: zeroshard/sharding/flat.py's [Note: a freed parameter is visibly empty])
and carries `ds_shape` and `ds_numel` (its full shape and size, DeepSpeed's names) and
`ds_tensor`: this rank's part, on the host. The parts split the flattened parameter into equal
slices, one per rank of the partition group (the last one zero-padded), as a flat's shards do;
the engine does not reuse them as shards (its flats pack several parameters and may be sharded
over another group): `initialize` gathers a unit's parameters from their parts once, builds the
unit's flat from them and drops the parts (`materialize`).

Every function here that communicates is a collective over the partition group: every rank
calls it for the same parameters in the same order (which holds because every rank runs the
same model constructor).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.launch.device import backends_by_device
from zeroshard.zero.param_attributes import assign_ds_id

_INFO = "_zeroshard_init_partition"  # the attribute a partitioned parameter carries
HOST = torch.device("cpu")


@dataclass(frozen=True)
class PartitionSpec:
    """How a parameter is partitioned: over `group`, `part_numel` elements per rank, its parts
    in `dtype` (pinned with `pin`)."""

    group: Group
    dtype: torch.dtype | None
    pin: bool


def is_partitioned(p: torch.Tensor) -> bool:
    """Whether `p` currently holds only this rank's part (its data is empty)."""
    return getattr(p, _INFO, None) is not None and getattr(p, "ds_tensor", None) is not None


def was_partitioned(p: torch.Tensor) -> bool:
    """Whether `p` was partitioned by an Init context and not yet adopted by an engine (it may
    be materialised right now, gathered on access)."""
    return getattr(p, _INFO, None) is not None


def _wire_device(group: Group) -> torch.device:
    """Where a collective over `group` takes its tensors: the host when the backend serves CPU
    tensors (gloo, "cpu:gloo,cuda:nccl"), the current GPU for NCCL alone."""
    if group.size == 1:
        return HOST
    get_config = getattr(dist, "get_backend_config", None)
    described = str(get_config(group.handle) if get_config is not None else dist.get_backend(group.handle))
    if "cpu" in backends_by_device(described):
        return HOST
    return torch.device("cuda", torch.cuda.current_device())


def _part_numel(numel: int, size: int) -> int:
    return max(1, -(-numel // size))


def partition(p: nn.Parameter, spec: PartitionSpec) -> None:
    """Keep only this rank's part of `p` (whose data is its full value now).

    The full value is first broadcast from the group's first rank, so every rank partitions
    the same values whatever its own constructor drew (what the engine's flats do without
    Init: every rank starts from the first rank's values)."""
    with torch.no_grad():
        full = p.data
        if spec.dtype is not None and full.is_floating_point() and full.dtype != spec.dtype:
            full = full.to(spec.dtype)
        shape, numel, size = full.shape, full.numel(), spec.group.size
        per_rank = _part_numel(numel, size)
        wire = _wire_device(spec.group)
        if numel == per_rank * size and full.is_contiguous() and full.device == wire:
            padded = full.view(-1)  # no padding needed: broadcast in place, no second full copy
        else:
            padded = torch.zeros(per_rank * size, dtype=full.dtype, device=wire)
            padded[:numel].copy_(full.reshape(-1))
        del full
        comm.broadcast(padded, group=spec.group, src=spec.group.ranks[0], tag="zero_init")
        mine = padded.narrow(0, spec.group.rank * per_rank, per_rank)
        part = torch.empty(per_rank, dtype=padded.dtype, device=HOST, pin_memory=spec.pin)
        part.copy_(mine)
        del padded, mine
        p.data = torch.empty(0, dtype=part.dtype, device=HOST)
    p.ds_shape, p.ds_numel, p.ds_tensor = shape, numel, part
    assign_ds_id(p)  # DeepSpeed numbers parameters as Init partitions them (param_attributes.py)
    setattr(p, _INFO, spec)
    p.convert_to_zero_parameters = functools.partial(convert_to_zero_parameters, spec)


def convert_to_zero_parameters(spec: PartitionSpec, params: Iterable[nn.Parameter]) -> None:
    """DeepSpeed's `param.convert_to_zero_parameters(param_list)` (bound on every partitioned
    parameter): partition parameters made after the Init context (an adapter attached to an
    Init-built model) over the same group, each in its own dtype, as DeepSpeed leaves them;
    those already partitioned are skipped. A collective, like `partition`."""
    keep = PartitionSpec(spec.group, None, spec.pin)
    for q in params:
        if not was_partitioned(q):
            partition(q, keep)


def gather(p: nn.Parameter) -> None:
    """Make `p` whole again from every rank's part (a collective); it stays marked as Init's
    (`was_partitioned`) until `partition` or `adopt`."""
    spec: PartitionSpec = getattr(p, _INFO)
    part = p.ds_tensor
    size = spec.group.size
    wire = _wire_device(spec.group)
    with torch.no_grad():
        full = torch.empty(part.numel() * size, dtype=part.dtype, device=wire)
        comm.all_gather(full, part.to(wire), group=spec.group, tag="zero_init")
        value = full.narrow(0, 0, p.ds_numel).to(HOST).view(p.ds_shape)
        p.data = value
    p.ds_tensor = None


def cast(p: nn.Parameter, dtype: torch.dtype) -> None:
    """Give a partitioned parameter's part (and its empty data) `dtype` (the engine's cast)."""
    with torch.no_grad():
        p.ds_tensor = p.ds_tensor.to(dtype)
        p.data = torch.empty(0, dtype=dtype, device=HOST)


def adopt(p: nn.Parameter) -> None:
    """Hand `p` to an engine: whole again (gathered if it is partitioned), Init's marks dropped.
    The engine then builds its flat from it (and at stage 3 frees it again, shard by shard)."""
    if is_partitioned(p):
        gather(p)
    for name in (_INFO, "ds_tensor", "convert_to_zero_parameters"):
        if hasattr(p, name):
            delattr(p, name)


def partitioned_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of `module` Init partitioned, each once, in `named_parameters` order."""
    return [p for p in module.parameters() if was_partitioned(p)]
