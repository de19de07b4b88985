"""DeepSpeed's `deepspeed.accelerator` path: `get_accelerator()` (zeroshard/launch/accelerator.py)."""

from zeroshard.launch.accelerator import get_accelerator, set_accelerator

__all__ = ["get_accelerator", "set_accelerator"]
