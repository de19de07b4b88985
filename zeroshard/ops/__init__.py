"""DeepSpeed's ``deepspeed.ops`` names that zeroshard provides (``zeroshard.ops.adam``)."""
