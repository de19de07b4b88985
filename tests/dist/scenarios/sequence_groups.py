"""Rank-side scenarios for tests/dist/sequence/test_sequence_groups.py (the sequence-parallel mpu)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from zeroshard.runtime.sequence_parallel import parallel_state_sp as mpu
from zeroshard.utils import groups


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def describe(sizes: list[int]) -> dict[str, Any]:
    """For each sequence-parallel size: what the mpu and zeroshard.groups report."""
    out: dict[str, Any] = {"before": (groups._get_sequence_parallel_group(),
                                      groups._get_sequence_parallel_world_size(),
                                      groups._get_sequence_parallel_rank())}
    for size in sizes:
        mpu.initialize_sequence_parallel(size)
        try:
            out[size] = {
                "sp": (_ranks(mpu.get_sequence_parallel_group()), mpu.get_sequence_parallel_world_size(),
                       mpu.get_sequence_parallel_rank()),
                "dp": (_ranks(mpu.get_data_parallel_group()), mpu.get_data_parallel_world_size(),
                       mpu.get_data_parallel_rank()),
                "sdp": (_ranks(mpu.get_sequence_data_parallel_group()), mpu.get_sequence_data_parallel_world_size(),
                        mpu.get_sequence_data_parallel_rank()),
                "mp": (_ranks(mpu.get_model_parallel_group()), mpu.get_model_parallel_world_size(),
                       mpu.get_model_parallel_rank()),
                "groups": (_ranks(groups._get_sequence_parallel_group()), groups._get_sequence_parallel_world_size(),
                           groups._get_sequence_parallel_rank()),
            }
            try:
                mpu.initialize_sequence_parallel(size)
                out[size]["twice"] = "no error"
            except RuntimeError as error:
                out[size]["twice"] = str(error)
        finally:
            mpu.destroy_sequence_parallel()
    try:
        mpu.initialize_sequence_parallel(3)
        out["bad"] = "no error"
    except ValueError as error:
        out["bad"] = str(error)
    return out
