"""DeepSpeed's `deepspeed.runtime.sequence_parallel.parallel_state_sp` path: re-exports of
`zeroshard.sequence.parallel_state_sp`."""

from zeroshard.sequence.parallel_state_sp import (
    destroy_sequence_parallel,
    get_data_parallel_group,
    get_data_parallel_rank,
    get_data_parallel_world_size,
    get_model_parallel_group,
    get_model_parallel_rank,
    get_model_parallel_world_size,
    get_sequence_data_parallel_group,
    get_sequence_data_parallel_rank,
    get_sequence_data_parallel_world_size,
    get_sequence_parallel_group,
    get_sequence_parallel_rank,
    get_sequence_parallel_world_size,
    initialize_sequence_parallel,
    is_initialized,
    sequence_parallel_layout,
)

__all__ = [
    "destroy_sequence_parallel",
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
    "is_initialized",
    "sequence_parallel_layout",
]
