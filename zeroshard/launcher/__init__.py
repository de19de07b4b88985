"""DeepSpeed's `deepspeed.launcher` path (the names integrations read; zeroshard's launching is
zeroshard/launch/: `zeroshard launch` is torchrun)."""

from zeroshard.launcher import runner

__all__ = ["runner"]
