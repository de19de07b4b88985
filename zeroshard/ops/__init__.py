"""DeepSpeed's ``deepspeed.ops`` names that zeroshard provides (``zeroshard.ops.adam``)."""

from zeroshard.ops import adam

__all__ = ["adam"]
