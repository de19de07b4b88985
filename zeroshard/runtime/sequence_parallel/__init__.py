"""Sequence parallelism under DeepSpeed's module paths: `parallel_state_sp` (the mpu) and
`ulysses_sp` (ALST: Hugging Face attention, the data-loader adapter, tiled compute)."""
