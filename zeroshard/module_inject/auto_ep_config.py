"""DeepSpeed's `deepspeed.module_inject.auto_ep_config` path: re-exports of `zeroshard.moe.autoep.spec`."""

from zeroshard.moe.autoep.spec import (
    AutoEPConfig,
    MoELayerSpec,
    fill_autoep_config_from_hf,
)

__all__ = [
    "AutoEPConfig",
    "MoELayerSpec",
    "fill_autoep_config_from_hf",
]
