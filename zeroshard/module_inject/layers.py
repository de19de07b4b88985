"""DeepSpeed's `deepspeed.module_inject.layers` path for AutoTP training: re-exports of
`zeroshard.autotp.layers` (the split Linear layers, by DeepSpeed's names)."""

from zeroshard.autotp.layers import LinearAllreduce, LinearLayer, TensorParallel_Layer

__all__ = ["LinearAllreduce", "LinearLayer", "TensorParallel_Layer"]
