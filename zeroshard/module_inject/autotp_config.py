"""DeepSpeed's `deepspeed.module_inject.autotp_config` path: re-exports of `zeroshard.autotp.specs`."""

from zeroshard.autotp.specs import AutoTPConfig, AutoTPPresets, PartitionType, TPLayerSpec, merge_autotp_configs

__all__ = ["AutoTPConfig", "AutoTPPresets", "PartitionType", "TPLayerSpec", "merge_autotp_configs"]
