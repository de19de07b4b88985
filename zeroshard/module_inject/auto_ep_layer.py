"""DeepSpeed's `deepspeed.module_inject.auto_ep_layer` path: re-exports of `zeroshard.moe.autoep.layer`."""

from zeroshard.moe.autoep.layer import (
    AutoEPMoELayer,
    AutoEPRouter,
    GroupedExperts,
    RouterGate,
)

__all__ = [
    "AutoEPMoELayer",
    "AutoEPRouter",
    "GroupedExperts",
    "RouterGate",
]
