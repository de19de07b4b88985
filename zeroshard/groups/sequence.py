"""The sequence-parallel group accessors of `zeroshard.utils.groups` (DeepSpeed's
`deepspeed.utils.groups._get_sequence_parallel_*`): read-only views onto the process's
`ParallelLayout` (zeroshard/sharding/layout.py).

They read the mpu the engine was given (`set_sequence_parallel_mpu`, called by `initialize`,
kept as the layout's `mpu`), else `parallel_state_sp` once it is initialized; without either
there is no sequence parallelism: world size 1, rank 0, and no group (None), as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from zeroshard.sharding.layout import current_layout

__all__ = [
    "set_sequence_parallel_mpu",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_world_size",
    "_get_sequence_parallel_rank",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_data_parallel_rank",
]


def set_sequence_parallel_mpu(mpu: Any) -> None:
    """The mpu the accessors read (None: fall back to parallel_state_sp, if initialized)."""
    current_layout().mpu = mpu


def _source() -> Any:
    from zeroshard.sequence import parallel_state_sp

    mpu = current_layout().mpu
    # parallel_state_sp counts only while initialized: an engine's mpu outlives destroy_sequence_parallel().
    if mpu is not None and mpu is not parallel_state_sp and hasattr(mpu, "get_sequence_parallel_group"):
        return mpu
    return parallel_state_sp if parallel_state_sp.is_initialized() else None


def _get_sequence_parallel_group() -> Any:
    source = _source()
    return None if source is None else source.get_sequence_parallel_group()


def _get_sequence_parallel_world_size() -> int:
    source = _source()
    return 1 if source is None else source.get_sequence_parallel_world_size()


def _get_sequence_parallel_rank() -> int:
    source = _source()
    return 0 if source is None else source.get_sequence_parallel_rank()


def _get_sequence_data_parallel_group() -> Any:
    source = _source()
    if source is None or not hasattr(source, "get_sequence_data_parallel_group"):
        return current_layout().world.handle
    return source.get_sequence_data_parallel_group()


def _get_sequence_data_parallel_world_size() -> int:
    source = _source()
    if source is None or not hasattr(source, "get_sequence_data_parallel_world_size"):
        return current_layout().world.size
    return source.get_sequence_data_parallel_world_size()


def _get_sequence_data_parallel_rank() -> int:
    source = _source()
    if source is None or not hasattr(source, "get_sequence_data_parallel_rank"):
        return current_layout().world.rank
    return source.get_sequence_data_parallel_rank()
