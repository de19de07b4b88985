"""DeepSpeed's `deepspeed.utils` import paths (`zeroshard.utils.groups`)."""
