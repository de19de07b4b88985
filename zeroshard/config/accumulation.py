"""Rules of `managed_gradient_accumulation: false` across sections (DeepSpeed 0.19's engine checks).

Unmanaged accumulation reduces at `step()`. At stages 0-1 that is one reduction after all the
backwards, so nothing can overlap them: DeepSpeed refuses `overlap_comm` there ("supports ZeRO
overlap_comm only with ZeRO stage 2"), and so does zeroshard, with the fix.
"""

from __future__ import annotations

from zeroshard.config.schema import ZeroshardConfig


def unmanaged_accumulation_problems(cfg: ZeroshardConfig) -> list[str]:
    """The problems of an unmanaged-accumulation config; none when accumulation is managed."""
    zero = cfg.zero_optimization
    if cfg.managed_gradient_accumulation or zero.stage >= 2 or not zero.overlap_comm:
        return []
    return [
        f"zero_optimization.overlap_comm=true: with managed_gradient_accumulation false, stage {zero.stage} "
        "reduces once at step(), after every backward, so no reduction can overlap one (DeepSpeed refuses "
        "it too). Remove overlap_comm, or use ZeRO stage 2 or 3, or managed accumulation."
    ]
