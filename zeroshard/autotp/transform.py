"""Splitting a model for tensor parallelism: the plan (zeroshard/autotp/plan.py) applied over a
tensor-parallel group.

`apply_autotp(model, settings, group)` runs at `initialize`, before any flat buffer is built
(zeroshard/engine/setup.py): every split Linear becomes a `LinearLayer` or `LinearAllreduce`
holding this rank's piece of its weight (`p.tp_split`, [Note: tensor-parallel splits]), and the
parameters the plan keeps whole but whose gradient depends on this rank's heads (Qwen3's
q_norm/k_norm) get a hook that sums the gradient over the group. Everything else is untouched
and stays whole on every rank of the group.

Every rank starts from the same whole weights: each is broadcast from the group's first rank
before it is cut (the engine's flats then broadcast each piece over the data-parallel group from
its first rank, so a run starts from global rank 0's model, as without tensor parallelism). A
model built under `zero.Init` has its weights gathered first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.autotp.layers import LinearAllreduce, LinearLayer, SharedInputs
from zeroshard.autotp.plan import COLUMN, LOCAL_COUNT_ATTRIBUTES, TensorParallelPlan, plan_tensor_parallel
from zeroshard.autotp.split import TensorSplit
from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.zero import partition as init_partition

__all__ = ["AutoTPResult", "apply_autotp", "repoint_parameters", "GRAD_SUM_TAG"]

GRAD_SUM_TAG = "tp.grad_sum"
INIT_TAG = "tp.init"


@dataclass
class AutoTPResult:
    """What `apply_autotp` did: the plan, the group, and each replaced parameter's successor
    (old id -> new parameter), for re-pointing an optimizer built before the split."""

    plan: TensorParallelPlan
    group: Group
    replaced: dict[int, nn.Parameter]


def _whole(p: nn.Parameter, group: Group) -> torch.Tensor:
    """`p`'s whole value, the same on every rank of `group` (the first rank's)."""
    if init_partition.is_partitioned(p):
        init_partition.adopt(p)
    value = p.detach().contiguous()
    comm.broadcast(value, group=group, src=group.ranks[0], tag=INIT_TAG)
    return value


def _piece(p: nn.Parameter, split: TensorSplit, group: Group) -> nn.Parameter:
    piece = nn.Parameter(split.piece_of(_whole(p, group)).clone(), requires_grad=p.requires_grad)
    piece.tp_split = split
    piece.tensor_model_parallel = True  # DeepSpeed's and Megatron's mark of a split parameter
    for attr in ("use_muon", "muon_num_heads"):  # optimizer tags set before initialize
        if hasattr(p, attr):
            setattr(piece, attr, getattr(p, attr))
    return piece


def _grad_sum_hook(group: Group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group, tag=GRAD_SUM_TAG)
        return grad

    return hook


def _scale_counts(module: nn.Module, parts: int) -> None:
    """DeepSpeed's update_mp_params: integer head/width counts a module keeps become its share."""
    for attr in LOCAL_COUNT_ATTRIBUTES:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % parts == 0 and value >= parts:
            setattr(module, attr, value // parts)


def apply_autotp(model: nn.Module, settings: Any, group: Group, plan: TensorParallelPlan | None = None) -> AutoTPResult:
    """Split `model` in place over `group` (collective over it: one broadcast per split weight).

    Raises:
        TensorParallelPlanError: a layer the plan cannot place (before anything changed).
    """
    plan = plan or plan_tensor_parallel(model, settings, group.size)
    inputs = SharedInputs(group)
    replaced: dict[int, nn.Parameter] = {}
    parents: set[str] = set()
    for placement in plan.split():
        parent_name, _, child = placement.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        split = TensorSplit(placement.dim, group.size, group.rank, placement.shape, placement.sub_sizes)
        weight = _piece(old.weight, split, group)
        replaced[id(old.weight)] = weight
        bias = None
        if old.bias is not None:
            if placement.kind == COLUMN:  # the bias follows the output features
                bias_split = TensorSplit(0, group.size, group.rank, tuple(old.bias.shape), placement.sub_sizes)
                bias = _piece(old.bias, bias_split, group)
            else:  # added once, after the sum: whole on every rank
                bias = nn.Parameter(_whole(old.bias, group).clone(), requires_grad=old.bias.requires_grad)
            replaced[id(old.bias)] = bias
        if placement.kind == COLUMN:
            new = LinearLayer(weight, bias, group, inputs, placement.gather_output, placement.name)
        else:
            new = LinearAllreduce(weight, bias, group, placement.name)
        new.to(old.weight.device)
        setattr(parent, child, new)
        parents.add(parent_name)
    for name in parents:
        _scale_counts(model.get_submodule(name) if name else model, group.size)
    params = dict(model.named_parameters())
    for name in plan.grad_sum:
        params[name].register_hook(_grad_sum_hook(group))
    model.ds_autotp_parsed = True  # DeepSpeed's mark that the model was split
    return AutoTPResult(plan, group, replaced)


def repoint_parameters(params: Any, replaced: dict[int, nn.Parameter]) -> Any:
    """`params` (None, parameters, (name, parameter) pairs or optimizer groups) with each parameter
    `apply_autotp` replaced swapped for its piece (DeepSpeed's remap after module replacement)."""
    if params is None:
        return None
    items = list(params)
    if items and isinstance(items[0], dict):
        return [dict(group, params=repoint_parameters(group["params"], replaced)) for group in items]
    if items and isinstance(items[0], tuple):
        return [(name, replaced.get(id(p), p)) for name, p in items]
    return [replaced.get(id(p), p) for p in items]
