"""Adam/AdamW whose moments are kept in a dtype of their own.

The precision table allows bf16 master weights with fp32 optimizer state
(`bf16.bf16_master_weights_and_grads` without `bf16_optimizer_states`). torch's Adam keeps its
moments in the parameter's dtype, so this optimizer does the same arithmetic as torch's
single-tensor AdamW in fp32 and stores the moments in `state_dtype` and the result in the
parameter's own dtype, for every tensor of a group at once (optim/foreach_adamw.py). State
names are torch's (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints and
`safe_get_full_optimizer_state` treat it like torch's Adam.
"""

from __future__ import annotations

import torch

from zeroshard.optim.foreach_adamw import adamw_foreach


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
            params = [p for p in group["params"] if p.grad is not None]
            adamw_foreach(
                params, [p.grad for p in params], [self.state[p] for p in params],
                lr=group["lr"], betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=group["decoupled"], state_dtype=self.state_dtype,
            )
        return loss
