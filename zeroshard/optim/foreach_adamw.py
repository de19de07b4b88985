"""AdamW on a list of tensors at once (torch._foreach_*), in fp32 whatever the storage dtypes.

The arithmetic of torch's single-tensor AdamW (decoupled weight decay, bias correction; or
Adam's L2 term), element for element: the same operations with the same scalars, so on CPU
the result is bitwise the per-tensor loop's. One kernel launch per operation for the whole
list instead of one per tensor and operation (on a GPU, ~15 launches per master per step
otherwise). Used by StateDtypeAdamW and by Muon's AdamW part.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch


def _fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor itself when fp32 or wider (updated in place), else an fp32 copy to write back."""
    return [t if t.dtype in (torch.float32, torch.float64) else t.float() for t in tensors]


def _write_back(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    pairs = [(t, v) for t, v in zip(targets, values, strict=True) if t is not v]
    if pairs:
        torch._foreach_copy_([t for t, _ in pairs], [v for _, v in pairs])


@torch.no_grad()
def adamw_foreach(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, Any]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool = True,
    state_dtype: torch.dtype | None = None,
) -> None:
    """One AdamW (or, with `decoupled=False`, Adam) step on every tensor of `params`.

    Args:
        params, grads, states: the tensors, their gradients and their optimizer states (torch's
            names: `step` a 0-d fp32 tensor on the host, `exp_avg`, `exp_avg_sq`; created here
            on the first step, the moments in `state_dtype`, default each tensor's own dtype).
    """
    if not params:
        return
    params, grads = list(params), list(grads)
    for p, state in zip(params, states, strict=True):
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(p, dtype=state_dtype or p.dtype)
    beta1, beta2 = betas
    lr, weight_decay = float(lr), float(weight_decay)
    torch._foreach_add_([s["step"] for s in states], 1)
    steps = [float(s["step"]) for s in states]  # host counters (torch's default placement): no device read
    exp_avg_t = [s["exp_avg"] for s in states]
    exp_avg_sq_t = [s["exp_avg_sq"] for s in states]
    param, grad = _fp32(params), _fp32(grads)
    exp_avg, exp_avg_sq = _fp32(exp_avg_t), _fp32(exp_avg_sq_t)
    if weight_decay != 0.0:
        if decoupled:
            torch._foreach_mul_(param, 1.0 - lr * weight_decay)
        else:
            grad = torch._foreach_add(grad, param, alpha=weight_decay)
    torch._foreach_lerp_(exp_avg, grad, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sq, beta2)
    torch._foreach_addcmul_(exp_avg_sq, grad, grad, value=1.0 - beta2)
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, [math.sqrt(1.0 - beta2**step) for step in steps])
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(param, exp_avg, denom, [-lr / (1.0 - beta1**step) for step in steps])
    _write_back(params, param)
    _write_back(exp_avg_t, exp_avg)
    _write_back(exp_avg_sq_t, exp_avg_sq)
