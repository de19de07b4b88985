"""DeepSpeed's `deepspeed.moe.ep_experts` path: re-exports of `zeroshard.moe.autoep.layer`."""

from zeroshard.moe.autoep.layer import GroupedExperts

__all__ = ["GroupedExperts"]
