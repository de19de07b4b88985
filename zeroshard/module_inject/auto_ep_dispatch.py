"""DeepSpeed's `deepspeed.module_inject.auto_ep_dispatch` path: re-exports of `zeroshard.moe.autoep.dispatch`."""

from zeroshard.moe.autoep.dispatch import (
    ExchangePlan,
    all_to_all_v,
    combine,
    dispatch,
)

__all__ = [
    "ExchangePlan",
    "all_to_all_v",
    "combine",
    "dispatch",
]
