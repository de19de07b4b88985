"""Build the optimizer from the config, or re-point a user's optimizer at the master tensors.

The engine's optimizer always steps on flat master tensors (one per flat buffer), never on
the module's parameters. The parameter-group structure the user asked for is kept: each
flat buffer holds parameters of exactly one optimizer group.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from zeroshard.config.error import ConfigError
from zeroshard.config.optimizer_params import NO_EFFECT, render_problems
from zeroshard.config.optimizers import OPTIMIZERS, optimizer_kind
from zeroshard.optim.cpu_adam import DeepSpeedCPUAdam
from zeroshard.optim.state_dtype_adamw import StateDtypeAdamW


def state_dtype_problem(opt_type: str, params: dict[str, Any]) -> str | None:
    """Why `opt_type` cannot keep its state in a dtype other than the masters', or None."""
    kind = optimizer_kind(opt_type)
    if kind is not None and kind.adam_family and params.get("amsgrad", False):
        return (
            "optimizer.params.amsgrad=true: not supported with optimizer state in a dtype "
            "other than the master weights' (bf16.bf16_master_weights_and_grads without "
            "bf16_optimizer_states). Drop amsgrad, or set bf16.bf16_optimizer_states=true."
        )
    if kind is not None and kind.name == "SGD":
        return (
            "optimizer.type=SGD: its momentum is kept in the master weights' dtype, but the plan asks "
            "for optimizer state in another dtype (bf16.bf16_master_weights_and_grads without "
            "bf16_optimizer_states). Set bf16.bf16_optimizer_states=true, or use Adam/AdamW."
        )
    return None


def fused_allowed(groups: list[dict[str, Any]]) -> bool:
    """Whether torch's fused Adam/AdamW can step these masters: every one a floating CUDA
    tensor. Elsewhere torch picks its own implementation (foreach on CUDA, the per-tensor loop
    on CPU, which the CPU conformance tests compare bit for bit)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)


def build_optimizer(
    opt_type: str,
    params: dict[str, Any],
    groups: list[dict[str, Any]],
    state_dtype: torch.dtype | None = None,
) -> torch.optim.Optimizer:
    """A torch optimizer of DeepSpeed type `opt_type` over `groups` (dicts with "params").

    `params` is a config's `optimizer.params`, already checked by the config validation (the
    same rules are applied again here, for callers that pass their own). `state_dtype`: the
    optimizer-state dtype the precision plan asks for when it differs from the master
    weights' dtype (bf16 masters with fp32 state); None when they agree.

    Raises:
        ConfigError: an unsupported type or parameter, naming the config key.
    """
    kind = optimizer_kind(opt_type)
    if kind is None or kind.built_by != "torch":
        built = ", ".join(k.name for k in OPTIMIZERS.values() if k.built_by == "torch")
        raise ConfigError(
            f"optimizer.type={opt_type!r}: not built here. Use one of {built}; the engine builds Muon itself "
            "from the config's optimizer section."
        )
    problems = render_problems(opt_type, params)
    if state_dtype is not None and (problem := state_dtype_problem(opt_type, params)):
        problems.append(problem)
    if problems:
        raise ConfigError(problems)
    kw = {k: v for k, v in params.items() if k not in NO_EFFECT}
    if kind.adam_family:
        kw.pop("bias_correction", None)
        adam_w = kw.pop("adam_w_mode", True)
        kw.setdefault("lr", 1e-3)
        kw.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam default, not torch's 0.01
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        if state_dtype is not None:
            kw.pop("amsgrad", None)
            return StateDtypeAdamW(groups, decoupled=adam_w, state_dtype=state_dtype, **kw)
        cls = torch.optim.AdamW if adam_w else torch.optim.Adam
        if "fused" not in kw and "foreach" not in kw and fused_allowed(groups):
            kw["fused"] = True  # one kernel per step for every master of a group
        return cls(groups, **kw)
    kw.setdefault("lr", 1e-3)
    return torch.optim.SGD(groups, **kw)


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, master_groups: list[list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """Make the user's optimizer step on the master tensors instead of the module's params.

    The optimizer object, its class, hyper-parameters and group structure stay as the user
    built them (so a scheduler bound to it keeps working); only each group's "params" list
    changes, and its (still empty) state is dropped.
    """
    if any(optimizer.state.values()):
        raise ValueError(
            "optimizer: it already has state (was it stepped?). Pass a freshly built optimizer "
            "to zeroshard.initialize; the engine rebuilds it over its master weights."
        )
    assert len(master_groups) == len(optimizer.param_groups)
    for group, masters in zip(optimizer.param_groups, master_groups, strict=False):
        group["params"] = list(masters)
    optimizer.state.clear()
    warnings.warn(
        f"zeroshard: re-pointed your {type(optimizer).__name__} at the engine's master weights "
        f"({len(master_groups)} param group(s), hyper-parameters unchanged).",
        stacklevel=3,
    )
    return optimizer


def build_host_optimizer(
    opt_type: str, params: dict[str, Any], groups: list[dict[str, Any]], state_dtype: torch.dtype | None
) -> torch.optim.Optimizer:
    """The config's optimizer over host masters: Adam/AdamW as the fused CPU kernel
    (DeepSpeedCPUAdam), anything else as `build_optimizer` makes it."""
    built = build_optimizer(opt_type, params, groups, state_dtype)  # validates the parameters
    if type(built) not in (torch.optim.Adam, torch.optim.AdamW):
        return built
    d = built.defaults
    return DeepSpeedCPUAdam(
        groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
        amsgrad=d["amsgrad"], adamw_mode=bool(d.get("decoupled_weight_decay", type(built) is torch.optim.AdamW)),
    )
