"""``DeepSpeedCPUAdagrad``: DeepSpeed's name and signature, torch's Adagrad underneath.

DeepSpeed's host kernel (csrc/includes/cpu_adagrad.h) adds ``weight_decay * param`` to the
gradient, accumulates its square and steps by ``lr * grad / (sqrt(sum) + eps)``: torch's
Adagrad with ``lr_decay=0`` and ``initial_accumulator_value=0`` is the same update. Accelerate
builds one in place of a ``torch.optim.Adagrad`` when the optimizer is offloaded
(``map_pytorch_optim_to_deepspeed``); the engine then re-points it at its master shards.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """Adagrad with L2 weight decay on host tensors.

    Args (DeepSpeed's): model_params, lr, eps, weight_decay, amsgrad (only False: Adagrad has no
    such variant; DeepSpeed accepts and ignores it), fp32_optimizer_states (the state is kept in
    the parameters' dtype; the engine's masters are fp32, so True and False agree there).
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdagrad(amsgrad=True): Adagrad has no AMSGrad variant (DeepSpeed ignores the flag). "
                "Pass amsgrad=False."
            )
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
