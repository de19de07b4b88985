"""Adam/AdamW whose moments are kept in a dtype of their own.

The precision table allows bf16 master weights with fp32 optimizer state
(`bf16.bf16_master_weights_and_grads` without `bf16_optimizer_states`). torch's Adam keeps its
moments in the parameter's dtype, so this optimizer does the same arithmetic as torch's
single-tensor AdamW in fp32 and stores the moments in `state_dtype` and the result in the
parameter's own dtype. State names are torch's (`step`, `exp_avg`, `exp_avg_sq`), so
checkpoints and `safe_get_full_optimizer_state` treat it like torch's Adam.
"""

from __future__ import annotations

import math

import torch


class StateDtypeAdamW(torch.optim.Optimizer):
    """Adam (decoupled=False) or AdamW with moments in `state_dtype`, arithmetic in fp32."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = True,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        self.state_dtype = state_dtype
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            eps, wd = group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                step = float(state["step"])
                grad = p.grad.float()
                param = p.float()
                if wd:
                    if group["decoupled"]:
                        param.mul_(1 - lr * wd)
                    else:
                        grad = grad.add(param, alpha=wd)
                exp_avg = state["exp_avg"].float().lerp_(grad, 1 - beta1)
                exp_avg_sq = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
                param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
                p.copy_(param)
        return loss
