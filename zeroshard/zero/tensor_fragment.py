"""DeepSpeed's `deepspeed.utils.tensor_fragment` helpers: read and write a parameter's fp32
master, reduced gradient and optimizer state, whole (`full`) or this rank's part (`local`).

Every stage keeps these in flat buffers whose master-side tensors (master, reduced gradient,
optimizer state) are either whole (stage 0) or one equal slice per rank (stages 1-3). A
parameter occupies `[offset, offset + numel)` of its flat; "local" is the part of that range
this rank's slice holds, flattened (at stage 0 the whole parameter; at stages 1-3 possibly
empty). The `full` getters are collectives at stages 1-3 (call them on every rank); the
`full` setters are not: each rank writes its own part of the value, so every rank must pass the
same full value. A frozen parameter (requires_grad False) has no master, gradient or optimizer
state: the getters return None, as DeepSpeed's do, and the setters refuse it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroshard.sharding.ranges import overlap
from zeroshard.zero.full_tensors import (
    _locate,
    frozen,
    optimizer_state_of,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
)

if TYPE_CHECKING:
    from zeroshard.sharding.flat import FlatParamGroup

__all__ = [
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


def _refuse_frozen(param: nn.Parameter, what: str) -> None:
    if frozen(param):
        raise ValueError(
            f"{what}: the parameter is frozen (requires_grad=False), so it has no master, gradient or "
            "optimizer state to write. Set its data directly, or unfreeze it before initialize."
        )


# ----------------------------------------------------------------------------- geometry
def _local_range(flat: FlatParamGroup, index: int) -> tuple[int, int, int]:
    """(start in the master-side tensor, start in the flattened parameter, length) of the part
    of parameter `index` this rank's master-side tensors hold (length 0: none)."""
    start, length = flat.master_range()
    common = overlap(flat.offsets[index], flat.offsets[index] + flat.numels[index], start, start + length)
    if common is None:
        return 0, 0, 0
    lo, hi = common
    return lo - start, lo - flat.offsets[index], hi - lo


def _flat_value(value: torch.Tensor, flat: FlatParamGroup, index: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: value must be a tensor, not {type(value).__name__}.")
    if tuple(value.shape) != tuple(flat.shapes[index]):
        raise ValueError(
            f"{what}: value has shape {tuple(value.shape)}, the parameter {tuple(flat.shapes[index])}. "
            "Pass the full (unpartitioned) tensor."
        )
    return value.detach().reshape(-1).to(flat.device)


def _local_value(value: torch.Tensor, flat: FlatParamGroup, index: int, what: str) -> torch.Tensor:
    _, _, length = _local_range(flat, index)
    if not isinstance(value, torch.Tensor) or value.numel() != length:
        got = value.numel() if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"{what}: value has {got} elements, this rank's part of the parameter {length}. "
            "Pass what the matching safe_get_local_* returned, changed in place or of the same size."
        )
    return value.detach().reshape(-1).to(flat.device)


# ----------------------------------------------------------------------------- writers
def _write_master(flat: FlatParamGroup, index: int, part: torch.Tensor, in_param: int) -> None:
    """Write `part` (elements `[in_param, in_param + len)` of the flattened parameter) into the
    master and into the parameter as the module holds it, so that the next forward and the
    next step both see it."""
    at, from_param, length = _local_range(flat, index)
    with torch.no_grad():
        if length:
            flat.master.narrow(0, at, length).copy_(part.narrow(0, from_param - in_param, length))

        def region() -> torch.Tensor:  # (a stage-3 full buffer without storage cannot be viewed)
            return flat.full.narrow(0, flat.offsets[index] + in_param, part.numel())

        if flat.params_sharded:  # stage 3: the parameter lives as this rank's shard
            overlap = flat.param_range_in_shard(index)
            # Gathering from the master (param_shard None): the master written above is it.
            if overlap is not None and flat.param_shard is not None:
                shard_at, param_at, n = overlap
                lo, hi = max(param_at, in_param), min(param_at + n, in_param + part.numel())
                if lo < hi:
                    flat.param_shard.narrow(0, shard_at + lo - param_at, hi - lo).copy_(
                        part.narrow(0, lo - in_param, hi - lo)
                    )
            if flat.state.value == "unsharded":  # gathered right now: keep the full copy in step
                region().copy_(part)
        else:  # stages 0-2: every rank holds the whole parameter
            region().copy_(part)


def _reduced_for_writing(flat: FlatParamGroup, what: str) -> torch.Tensor:
    grads = flat.grads
    if grads.holds_unreduced() and not flat.policy.reduce_every_backward and grads.reduced is None:
        raise RuntimeError(
            f"{what}: this rank holds gradients not reduced yet (a backward that was not the "
            "accumulation boundary). Call it after the boundary backward, before engine.step()."
        )
    grads.host_landed = 0  # the caller changes it: an offloaded step must move it again
    return grads.reduced_buffer()


def _write_grad(registry, flat: FlatParamGroup, index: int, part: torch.Tensor, in_param: int, what: str) -> None:
    at, from_param, length = _local_range(flat, index)
    reduced = _reduced_for_writing(flat, what)
    scale = registry.loss_scale()  # the reduced gradient is kept scaled until the step
    with torch.no_grad():
        if flat.grads.reduced_full is not None:
            # Stages 0-1: the whole reduced gradient (which `param.grad` views) holds the
            # master's range too, so writing all of `part` there keeps both in step.
            region = flat.grads.reduced_full.narrow(0, flat.offsets[index] + in_param, part.numel())
            region.copy_(part if scale == 1.0 else part * scale)
        elif length:
            piece = part.narrow(0, from_param - in_param, length)
            reduced.narrow(0, at, length).copy_(piece if scale == 1.0 else piece * scale)


def _state_tensor(registry, flat: FlatParamGroup, key: str, what: str) -> torch.Tensor:
    optimizer = registry.optimizer()
    state = optimizer.state.get(flat.master, {}) if optimizer is not None else {}
    if key not in state:
        raise KeyError(
            f"{what}: the optimizer has no state {key!r} for this parameter (known: {sorted(state)}). "
            "Optimizer state exists after the first engine.step()."
        )
    return state[key]


def _write_state(registry, flat, index, key, part, in_param, what) -> None:
    tensor = _state_tensor(registry, flat, key, what)
    with torch.no_grad():
        if tensor.dim() == 0:
            raise ValueError(
                f"{what}: {key!r} is a scalar shared by the whole flat buffer; it cannot be set per parameter."
            )
        at, from_param, length = _local_range(flat, index)
        if length:
            tensor.narrow(0, at, length).copy_(part.narrow(0, from_param - in_param, length))


# ----------------------------------------------------------------------------- full
# The getters are zeroshard.zero.full_tensors' (imported above), so every path to them
# is one function.


def safe_set_full_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master weight (and the parameter itself, in its dtype)."""
    what = "safe_set_full_fp32_param"
    _refuse_frozen(param, what)
    _, flat, index = _locate(param)
    _write_master(flat, index, _flat_value(value, flat, index, what), 0)


def safe_set_full_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """Set the parameter's reduced, unscaled gradient, which the next `engine.step()` applies
    (after the boundary backward; before any backward, the other parameters' gradients are
    zero)."""
    what = "safe_set_full_grad"
    _refuse_frozen(param, what)
    registry, flat, index = _locate(param)
    _write_grad(registry, flat, index, _flat_value(value, flat, index, what), 0, what)


def safe_set_full_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the optimizer state `optim_state_key` of the parameter (after the first step)."""
    what = "safe_set_full_optimizer_state"
    _refuse_frozen(param, what)
    registry, flat, index = _locate(param)
    _write_state(registry, flat, index, optim_state_key, _flat_value(value, flat, index, what), 0, what)


def safe_update_full_grad_vectorized(param_list: list[nn.Parameter], update_func: Callable) -> None:
    """`safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))` for every trainable
    parameter of `param_list` (a collective: every rank passes the same list)."""
    for p in param_list:
        if frozen(p):
            continue
        old = safe_get_full_grad(p)
        if old is None:
            raise RuntimeError(
                "safe_update_full_grad_vectorized: no reduced gradient yet. Call it after the boundary "
                "backward, before engine.step()."
            )
        safe_set_full_grad(p, update_func(old, p))


# ----------------------------------------------------------------------------- local
def _local_slice(flat: FlatParamGroup, index: int, tensor: torch.Tensor) -> torch.Tensor:
    at, _, length = _local_range(flat, index)
    return tensor.narrow(0, at, length).detach().to(torch.float32, copy=True)


def safe_get_local_fp32_param(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of the fp32 master, flattened (see the module docstring)."""
    if frozen(param):
        return None
    _, flat, index = _locate(param)
    return _local_slice(flat, index, flat.master)


def safe_get_local_grad(param: nn.Parameter) -> torch.Tensor | None:
    """This rank's part of the reduced, unscaled gradient, flattened; None when there is none."""
    if frozen(param):
        return None
    registry, flat, index = _locate(param)
    if flat.grads.reduced is None:
        return None
    part = _local_slice(flat, index, flat.grads.reduced)
    scale = registry.loss_scale()
    return part if scale == 1.0 else part / scale


def safe_get_local_optimizer_state(param: nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's part of the optimizer state `optim_state_key`, flattened."""
    found = optimizer_state_of(param, optim_state_key)
    if found is None:
        return None
    flat, index, value = found
    return value.detach().clone() if value.dim() == 0 else _local_slice(flat, index, value)


def safe_set_local_fp32_param(param: nn.Parameter, value: torch.Tensor) -> None:
    what = "safe_set_local_fp32_param"
    _refuse_frozen(param, what)
    _, flat, index = _locate(param)
    _, from_param, _ = _local_range(flat, index)
    _write_master(flat, index, _local_value(value, flat, index, what), from_param)


def safe_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    what = "safe_set_local_grad"
    _refuse_frozen(param, what)
    registry, flat, index = _locate(param)
    _, from_param, _ = _local_range(flat, index)
    _write_grad(registry, flat, index, _local_value(value, flat, index, what), from_param, what)


def safe_set_local_optimizer_state(param: nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    what = "safe_set_local_optimizer_state"
    _refuse_frozen(param, what)
    registry, flat, index = _locate(param)
    _, from_param, _ = _local_range(flat, index)
    _write_state(registry, flat, index, optim_state_key, _local_value(value, flat, index, what), from_param, what)
