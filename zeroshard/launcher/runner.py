"""DeepSpeed's `deepspeed.launcher.runner` path: the constants Accelerate reads from it."""

from zeroshard.launch.launchers import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
