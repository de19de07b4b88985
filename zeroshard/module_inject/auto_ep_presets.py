"""DeepSpeed's `deepspeed.module_inject.auto_ep_presets` path: re-exports of `zeroshard.moe.autoep.presets`."""

from zeroshard.moe.autoep.presets import (
    PRESETS,
    MoEPreset,
    RoutingSettings,
    preset_for_model_type,
    resolve_routing,
)

__all__ = [
    "MoEPreset",
    "PRESETS",
    "RoutingSettings",
    "preset_for_model_type",
    "resolve_routing",
]
