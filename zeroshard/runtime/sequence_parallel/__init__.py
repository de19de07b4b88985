"""Sequence parallelism under DeepSpeed's module paths: `parallel_state_sp` (the mpu) and
`ulysses_sp` (ALST: Hugging Face attention, the data-loader adapter, tiled compute)."""

from zeroshard.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
