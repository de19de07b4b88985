"""DeepSpeed's `deepspeed.moe.ep_router` path: re-exports of `zeroshard.moe.autoep.token_choice`."""

from zeroshard.moe.autoep.token_choice import TokenChoiceTopKRouter

__all__ = ["TokenChoiceTopKRouter"]
