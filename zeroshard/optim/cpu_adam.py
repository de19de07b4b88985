"""``DeepSpeedCPUAdam``: DeepSpeed's name and signature, torch's fused CPU Adam underneath.

DeepSpeed builds a C++ extension for the host-side Adam of ZeRO-Offload; torch ships a fused
CPU kernel (``torch.optim.Adam(fused=True)``) that does the same update, about 5x faster than
the foreach version on 2 cores (benchmarks/offload.py). The engine builds this optimizer
itself for an offloaded Adam/AdamW from the config; users who construct one get the same.

Each parameter keeps its own step count, advanced once per ``step()``: there is no sub-group
or group-level counter that a second call for the same logical step could advance twice
(DeepSpeed's bias-correction drift). The engine never calls ``step()`` twice for one step
(zeroshard/step/optimizer_step.py), and a repeated ``engine.step()`` with no backward in between is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedCPUAdam(torch.optim.Adam):
    """Adam (``adamw_mode=False``: L2 weight decay) or AdamW (decoupled, the default) on host
    tensors with torch's fused CPU kernel.

    Args (DeepSpeed's): model_params, lr, bias_correction (only True: torch's Adam always
    corrects), betas, eps, weight_decay, amsgrad, adamw_mode, fp32_optimizer_states (the
    state is kept in the parameters' dtype; the engine's masters are fp32, so True and False
    agree there).
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if not bias_correction:
            raise ValueError(
                "DeepSpeedCPUAdam(bias_correction=False): not supported by zeroshard (torch's fused "
                "Adam always corrects the moment estimates). Use bias_correction=True."
            )
        self.adamw_mode = adamw_mode
        # Checkpoints name the state's family (AdamW or Adam), so they move to and from
        # engines without offload (zeroshard/checkpoint/load.py).
        self.checkpoint_class = "AdamW" if adamw_mode else "Adam"
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(
            model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
            fused=True, decoupled_weight_decay=adamw_mode,
        )

    @torch.no_grad()
    def step(self, closure: Any = None, fp16_param_groups: Any = None) -> Any:  # DeepSpeed's signature
        if fp16_param_groups is not None:
            raise ValueError(
                "DeepSpeedCPUAdam.step(fp16_param_groups=...): not supported; the engine publishes "
                "the updated masters into the parameters itself. Call step() without it."
            )
        return super().step(closure)
