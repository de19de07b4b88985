"""DeepSpeed's `deepspeed.module_inject.auto_ep_balance` path: re-exports of `zeroshard.moe.autoep.balance`."""

from zeroshard.moe.autoep.balance import (
    LoadBalancer,
    balance_step,
)

__all__ = [
    "LoadBalancer",
    "balance_step",
]
