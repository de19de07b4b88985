"""Config keys of sequence parallelism: `sequence_parallel_size` and `data_parallel_size`
build a (data, sequence) layout; the batch-size triangle counts data-parallel replicas."""

from __future__ import annotations

import pytest

from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}


def test_triangle_counts_data_parallel_replicas() -> None:
    cfg = resolve_config({**BASE, "sequence_parallel_size": 2}, world_size=8)
    assert (cfg.sequence_parallel_size, cfg.data_parallel_size, cfg.train_batch_size) == (2, 4, 2 * 3 * 4)
    cfg = resolve_config({**BASE, "sequence_parallel_size": 2, "data_parallel_size": 2}, world_size=4)
    assert cfg.train_batch_size == 12
    plain = resolve_config(BASE, world_size=4)
    assert (plain.sequence_parallel_size, plain.data_parallel_size, plain.train_batch_size) == (1, 4, 24)


def test_groups_from_an_mpu_set_the_size() -> None:
    cfg = resolve_config(BASE, world_size=4, sequence_parallel_size=4)
    assert (cfg.sequence_parallel_size, cfg.data_parallel_size, cfg.train_batch_size) == (4, 1, 6)


@pytest.mark.parametrize(
    "extra, world, given, message",
    [
        ({"sequence_parallel_size": 3}, 4, None, r"sequence_parallel_size=3: must divide the world size 4\. "),
        ({"sequence_parallel_size": 2, "data_parallel_size": 4}, 4, None,
         r"data_parallel_size=4: must be world size 4 / sequence_parallel_size 2 = 2\. Fix one of them"),
        ({"sequence_parallel_size": 2}, 4, 4,
         r"sequence_parallel_size=2: the sequence-parallel groups given \(mpu\) have 4 ranks\. "),
        ({"sequence_parallel_size": 0}, 4, None, r"sequence_parallel_size=0"),
        ({"train_batch_size": 24, "sequence_parallel_size": 2}, 4, None, r"train_batch_size=24"),
    ],
)
def test_bad_sizes_are_refused(extra, world, given, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config({**BASE, **extra}, world_size=world, sequence_parallel_size=given)
