"""DeepSpeed's `deepspeed.utils` import path: `from zeroshard.utils import groups`."""

from . import groups

__all__ = ["groups"]
