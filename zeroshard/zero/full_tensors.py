"""Full (unsharded) views of a parameter's fp32 weight, gradient and optimizer state.

DeepSpeed's `safe_get_full_*` helpers: every rank gets the whole tensor whatever the
stage. They are collectives at stages 1-3 (a shard lives on each rank), so every rank must
call them, in the same order. A frozen parameter (requires_grad False) has no master, gradient
or optimizer state: they answer None for it, as DeepSpeed 0.19's do (no collective then).

The one implementation: `zeroshard.safe_get_full_*` and DeepSpeed's paths
(`zeroshard.utils`, `zeroshard.utils.tensor_fragment`, `zeroshard.zero.tensor_fragment`)
are these functions.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.sharding.flat import FlatParamGroup
from zeroshard.sharding.gather import GatherPiece, all_gather_shards
from zeroshard.sharding.registry import ParamRegistry, registry_of


def frozen(param: nn.Parameter) -> bool:
    """A parameter the engine holds no master, gradient or optimizer state for."""
    return not param.requires_grad


def _locate(param: nn.Parameter) -> tuple[ParamRegistry, FlatParamGroup, int]:
    registry = registry_of(param)
    flat, index = registry.locate(param)
    return registry, flat, index


def _full_flat(flat: FlatParamGroup, master_layout: torch.Tensor) -> torch.Tensor:
    """The full flat buffer of a tensor laid out like the flat's master (full or shard)."""
    if not flat.policy.shard_optimizer:
        return master_layout
    full = torch.empty(flat.padded_numel, dtype=master_layout.dtype, device=master_layout.device)
    # Exact: the helpers return the values as stored.
    all_gather_shards([GatherPiece(master_layout, full)], group=flat.spec.shard, tag="full_tensor").wait()
    return full


def _param_slice(flat: FlatParamGroup, full: torch.Tensor, index: int) -> torch.Tensor:
    return flat.param_view(full, index).detach().to(torch.float32, copy=True)


def safe_get_full_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """The parameter's master weight, full size, in fp32; None for a frozen parameter."""
    if frozen(param):
        return None
    _, flat, index = _locate(param)
    return _param_slice(flat, _full_flat(flat, flat.master), index)


def safe_get_full_grad(param: nn.Parameter) -> torch.Tensor | None:
    """The accumulated, reduced (averaged), unscaled gradient, full size, in fp32.

    Valid between the boundary backward and `engine.step()`; zeros for a parameter that
    took no part in the backward. Read from the master-side shards (what the step applies),
    also at stage 1 where every rank holds the whole reduced gradient (`param.grad`): after
    `safe_set_local_grad` only the shards agree everywhere. None for a frozen parameter, and
    when no reduced gradient exists yet (before the boundary backward, or after the step
    cleared it).
    """
    if frozen(param):
        return None
    registry, flat, index = _locate(param)
    reduced = flat.grads.reduced
    has_any = torch.tensor([0 if reduced is None else 1], device=flat.device)
    comm.all_reduce(has_any, group=flat.spec.shard, op=torch.distributed.ReduceOp.MAX, tag="full_tensor")
    if int(has_any) == 0:
        return None
    if reduced is None:
        reduced = flat.grads.reduced_buffer()
    full = _param_slice(flat, _full_flat(flat, reduced), index)
    scale = registry.loss_scale()
    return full if scale == 1.0 else full / scale


def safe_get_full_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state `optim_state_key` (torch's names: exp_avg, exp_avg_sq,
    momentum_buffer, step) for this parameter, full size; None for a frozen parameter or a
    state the optimizer does not keep."""
    found = optimizer_state_of(param, optim_state_key)
    if found is None:
        return None
    flat, index, value = found
    if value.dim() == 0:
        return value.detach().clone()  # a scalar such as `step`
    return _param_slice(flat, _full_flat(flat, value), index)


def optimizer_state_of(param: nn.Parameter, optim_state_key: str):
    """(flat, index in the flat, this rank's state tensor of `optim_state_key` for the flat's
    master) or None for a frozen parameter or a state the optimizer does not keep."""
    if frozen(param):
        return None
    registry, flat, index = _locate(param)
    optimizer = registry.optimizer()
    state = optimizer.state.get(flat.master, {}) if optimizer is not None else {}
    value = state.get(optim_state_key)
    return None if value is None else (flat, index, value)
