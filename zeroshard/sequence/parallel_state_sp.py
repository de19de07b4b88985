"""The sequence-parallel mpu: process groups for data x sequence parallelism.

A module with DeepSpeed's functions, passed as `initialize(..., mpu=parallel_state_sp)` or
returned by `UlyssesSPAttentionHF.register_with_transformers`. World = DP x SP: sequence groups
are blocks of SP consecutive ranks (they exchange activations in every attention layer; keep
them inside a node), data-parallel groups are the strided ranks holding the same sequence
slice of different samples, and the sequence-data-parallel group is every rank (dense
parameters are sharded over it: DESIGN section 9).

Group getters return torch ProcessGroups, as DeepSpeed's do (users pass them to
torch.distributed and to the data-loader adapter); `sequence_parallel_layout()` gives the same
groups as `zeroshard.comm.Group`s for the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.comm import collectives as comm

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


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's groups (global ranks in `.ranks`).

    Attributes:
        sequence: the SP consecutive ranks sharing one sample's sequence.
        data: the DP strided ranks holding the same sequence slice of different samples.
        sequence_data: every rank of the layout (data x sequence).
        model: this rank alone (no tensor parallelism; DeepSpeed's mpu protocol asks for it).
    """

    sequence: comm.Group
    data: comm.Group
    sequence_data: comm.Group
    model: comm.Group


_GROUPS: SequenceParallelGroups | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the groups for `sequence_parallel_size` (collective: every rank calls it)."""
    global _GROUPS
    if _GROUPS is not None:
        raise RuntimeError(
            "sequence parallelism is already initialized in this process. Call destroy_sequence_parallel() first."
        )
    world = comm.world_group()
    size = sequence_parallel_size
    if not isinstance(size, int) or size < 1 or world.size % size:
        raise ValueError(
            f"sequence_parallel_size={size}: must be a positive divisor of the world size {world.size}. "
            "Launch a multiple of it ranks, or pick a divisor."
        )
    blocks = [world.ranks[i : i + size] for i in range(0, world.size, size)]
    strides = [world.ranks[i::size] for i in range(size)]
    me = world.ranks[world.rank]

    def mine(family: list[tuple[int, ...]]) -> comm.Group:
        found = None
        for members in family:  # every rank creates every group, in the same order
            group = comm.new_process_group(members, world)
            if me in members:
                found = group
        assert found is not None
        return found

    sequence, data = mine(blocks), mine(strides)
    model = mine([(r,) for r in world.ranks])
    _GROUPS = SequenceParallelGroups(sequence, data, world, model)


def destroy_sequence_parallel() -> None:
    """Forget the groups (torch keeps the process groups until the default group goes)."""
    global _GROUPS
    _GROUPS = None


def is_initialized() -> bool:
    return _GROUPS is not None


def sequence_parallel_layout() -> SequenceParallelGroups:
    """The groups as `zeroshard.comm.Group`s."""
    if _GROUPS is None:
        raise RuntimeError(
            "sequence parallel groups are not initialized. Call initialize_sequence_parallel(size) "
            "(or UlyssesSPAttentionHF.register_with_transformers) first."
        )
    return _GROUPS


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


def get_model_parallel_group():
    return sequence_parallel_layout().model.handle


def get_model_parallel_world_size() -> int:
    return 1


def get_model_parallel_rank() -> int:
    return 0
