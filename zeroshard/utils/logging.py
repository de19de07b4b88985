"""DeepSpeed's `deepspeed.utils.logging` path: zeroshard's logger and `log_dist`."""

from zeroshard.monitor.log import log_dist, logger

__all__ = ["log_dist", "logger"]
