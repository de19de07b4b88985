"""DeepSpeed's `deepspeed.runtime.utils` path: `move_to_device` (zeroshard/launch/device.py)."""

from zeroshard.launch.device import move_to_device

__all__ = ["move_to_device"]
