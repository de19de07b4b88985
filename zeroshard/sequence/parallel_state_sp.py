"""The sequence-parallel mpu: process groups for data x sequence parallelism.

A module with DeepSpeed's functions, passed as `initialize(..., mpu=parallel_state_sp)` or
returned by `UlyssesSPAttentionHF.register_with_transformers`. World = DP x SP: sequence groups
are blocks of SP consecutive ranks (they exchange activations in every attention layer; keep
them inside a node), data-parallel groups are the strided ranks holding the same sequence
slice of different samples, and the sequence-data-parallel group is every rank (dense
parameters are sharded over it: docs/design.md section 9).

Group getters return torch ProcessGroups, as DeepSpeed's do (users pass them to
torch.distributed and to the data-loader adapter); `sequence_parallel_layout()` gives the same
groups as `zeroshard.comm.Group`s for the engine.

The groups live in the process's `ParallelLayout` (zeroshard/sharding/layout.py); these
functions are read-only views onto it (and the two that build and forget them).
"""

from __future__ import annotations

from zeroshard.sharding.layout import SequenceParallelGroups, current_layout  # noqa: F401  (its old home)

__all__ = [
    "initialize_sequence_parallel",
    "destroy_sequence_parallel",
    "is_initialized",
    "sequence_parallel_layout",
    "get_sequence_parallel_group",
    "get_sequence_parallel_world_size",
    "get_sequence_parallel_rank",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_world_size",
    "get_sequence_data_parallel_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    "get_model_parallel_group",
    "get_model_parallel_world_size",
    "get_model_parallel_rank",
]


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups for `sequence_parallel_size` (collective: every rank calls it)."""
    current_layout().init_sequence_mpu(sequence_parallel_size)


def destroy_sequence_parallel() -> None:
    """Forget the groups (torch keeps the process groups until the default group goes)."""
    current_layout().drop_sequence_mpu()


def is_initialized() -> bool:
    return current_layout().sequence_mpu is not None


def sequence_parallel_layout() -> SequenceParallelGroups:
    """The groups as `zeroshard.comm.Group`s."""
    groups = current_layout().sequence_mpu
    if groups is None:
        raise RuntimeError(
            "sequence parallel groups are not initialized. Call initialize_sequence_parallel(size) "
            "(or UlyssesSPAttentionHF.register_with_transformers) first."
        )
    return groups


def get_sequence_parallel_group():
    return sequence_parallel_layout().sequence.handle


def get_sequence_parallel_world_size() -> int:
    return sequence_parallel_layout().sequence.size


def get_sequence_parallel_rank() -> int:
    return sequence_parallel_layout().sequence.rank


def get_sequence_data_parallel_group():
    return sequence_parallel_layout().sequence_data.handle


def get_sequence_data_parallel_world_size() -> int:
    return sequence_parallel_layout().sequence_data.size


def get_sequence_data_parallel_rank() -> int:
    return sequence_parallel_layout().sequence_data.rank


def get_data_parallel_group():
    return sequence_parallel_layout().data.handle


def get_data_parallel_world_size() -> int:
    return sequence_parallel_layout().data.size


def get_data_parallel_rank() -> int:
    return sequence_parallel_layout().data.rank


# DeepSpeed's sequence mpu aliases model parallelism to sequence parallelism (its only other
# dimension); code written against it (DeepSpeed's own Ulysses tests) reads the sequence rank there.
get_model_parallel_group = get_sequence_parallel_group
get_model_parallel_world_size = get_sequence_parallel_world_size
get_model_parallel_rank = get_sequence_parallel_rank
