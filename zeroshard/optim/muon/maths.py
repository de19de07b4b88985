"""The per-tensor maths both Muon optimizers share: momentum, the AdamW part, applying an update."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from zeroshard.optim.foreach_adamw import adamw_foreach
from zeroshard.optim.muon.newton_schulz import NS_METHODS, resolve_ns_dtype
from zeroshard.optim.muon.settings import MuonSettings


def state_tensor(state: dict[str, Any], key: str, like: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if key not in state:
        state[key] = torch.zeros_like(like, dtype=dtype or like.dtype)
    return state[key]


def in_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it is fp32 or wider (updated in place), else an fp32 copy to write back."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def adamw_group_step(params: list[torch.Tensor], states: list[dict[str, Any]], group: Mapping[str, Any],
                      state_dtype: torch.dtype | None = None) -> None:
    """torch's AdamW (decoupled weight decay, bias correction) on every tensor of a group at
    once, in fp32 whatever the dtypes of the masters and of the moments (`state_dtype`,
    default each master's)."""
    adamw_foreach(
        params, [p.grad for p in params], states, lr=group["lr"], betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"], state_dtype=state_dtype,
    )


def momentum_direction(grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
                        state_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Update the momentum in `state` with `grad`; return u (Nesterov or plain momentum) in
    fp32 or wider, whatever the dtypes of the gradient and the momentum (`state_dtype`)."""
    m_t = state_tensor(state, "momentum_buffer", grad, state_dtype)
    beta = float(group["momentum"])
    grad, m = in_fp32(grad), in_fp32(m_t)
    m.mul_(beta).add_(grad, alpha=1.0 - beta)
    if m is not m_t:
        m_t.copy_(m)
    if group["nesterov"]:
        return grad.mul(1.0 - beta).add_(m, alpha=beta)
    return m  # read only from here on


def apply_update(p: torch.Tensor, update: torch.Tensor, group: Mapping[str, Any]) -> None:
    """p <- p (1 - lr wd) - lr update, in fp32 or wider."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    param = in_fp32(p)
    if wd != 0.0:
        param.mul_(1.0 - lr * wd)
    param.add_(update, alpha=-lr)
    if param is not p:
        p.copy_(param)


def compute_dtype_of(group: Mapping[str, Any], like: torch.Tensor) -> torch.dtype:
    return resolve_ns_dtype(group["ns_dtype"], like.device, group["ns_method"], like.dtype)


def fill_group_defaults(group: dict[str, Any]) -> None:
    if "use_muon" not in group:
        raise ValueError(
            "Muon optimizer group without 'use_muon': build the groups with split_param_groups "
            "(the engine does), or pass use_muon=True/False in every group."
        )
    for key, value in MuonSettings().group_defaults(bool(group["use_muon"])).items():
        group.setdefault(key, value)
    if group["use_muon"] and group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method={group['ns_method']!r}: must be one of {', '.join(NS_METHODS)}.")

