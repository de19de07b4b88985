"""DeepSpeed's `deepspeed.runtime.lr_schedules` path: the schedules and `VALID_LR_SCHEDULES`
(zeroshard/optim/schedulers.py)."""

from zeroshard.optim.schedulers import VALID_LR_SCHEDULES, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["VALID_LR_SCHEDULES", "OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
