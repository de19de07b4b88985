"""DeepSpeed's `deepspeed.runtime` import paths that users' scripts name."""
