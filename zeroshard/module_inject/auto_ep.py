"""DeepSpeed's `deepspeed.module_inject.auto_ep` path: re-exports of `zeroshard.moe.autoep.swap`."""

from zeroshard.moe.autoep.swap import (
    AutoEPMoELayer,
    autoep_layers,
    replace_moe_layers,
)

__all__ = [
    "AutoEPMoELayer",
    "autoep_layers",
    "replace_moe_layers",
]
