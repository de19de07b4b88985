"""DeepSpeed's `deepspeed.ops.adam` path: re-exports of `zeroshard.optim.cpu_adam`."""

from zeroshard.optim.cpu_adam import (
    DeepSpeedCPUAdam,
)

__all__ = [
    "DeepSpeedCPUAdam",
]
