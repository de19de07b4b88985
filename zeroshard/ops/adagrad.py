"""DeepSpeed's `deepspeed.ops.adagrad` path: re-exports of `zeroshard.optim.cpu_adagrad`."""

from zeroshard.optim.cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
