"""DeepSpeed's `deepspeed.launcher.runner` path: the constants Accelerate reads from it, and
`main`, the `deepspeed` command (one node, zeroshard/launch/deepspeed_launcher.py)."""

from zeroshard.launch.deepspeed_launcher import main
from zeroshard.launch.launchers import DEEPSPEED_ENVIRONMENT_NAME

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME", "main"]
