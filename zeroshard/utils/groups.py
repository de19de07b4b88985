"""DeepSpeed's `deepspeed.utils.groups`: the parallel-group accessors users' code calls.

One module per dimension, re-exported here: sequence parallelism (`sequence_groups`).
"""

from .sequence_groups import (  # noqa: F401
    _get_sequence_data_parallel_group,
    _get_sequence_data_parallel_rank,
    _get_sequence_data_parallel_world_size,
    _get_sequence_parallel_group,
    _get_sequence_parallel_rank,
    _get_sequence_parallel_world_size,
    set_sequence_parallel_mpu,
)
