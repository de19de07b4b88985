"""`managed_gradient_accumulation: false` beside `overlap_comm`, as DeepSpeed 0.19's
TestUnmanagedGradientAccumulationOverlapCommValidation (tests/unit/v1/zero/test_zero_user_backward.py)
asserts: refused at stages 0-1, accepted at stage 2 (its TestUnmanagedGradientAccumulationOverlapCommStage2)."""

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


def _config(stage, overlap_comm, managed=False):
    return {"train_batch_size": 1, "managed_gradient_accumulation": managed,
            "zero_optimization": {"stage": stage, "overlap_comm": overlap_comm}}


@pytest.mark.parametrize("stage", [0, 1])
def test_unmanaged_accumulation_refuses_overlap_comm_at_stages_0_and_1(stage):
    with pytest.raises(ConfigError, match=(
        rf"zero_optimization\.overlap_comm=true: with managed_gradient_accumulation false, stage {stage} "
        r"reduces once at step\(\).*Remove overlap_comm, or use ZeRO stage 2 or 3")):
        resolve_config(_config(stage, True))


@pytest.mark.parametrize("stage, overlap_comm, managed", [
    (2, True, False), (3, True, False), (0, False, False), (1, False, False), (1, True, True),
])
def test_the_other_combinations_are_accepted(stage, overlap_comm, managed):
    cfg = resolve_config(_config(stage, overlap_comm, managed))
    assert (cfg.managed_gradient_accumulation, cfg.zero_optimization.overlap_comm) == (managed, overlap_comm)
