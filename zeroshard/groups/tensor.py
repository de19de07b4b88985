"""DeepSpeed's tensor-parallel getters (`deepspeed.utils.groups`, the names AutoTP and Megatron-
style code call): views onto the layout's tensor dimension (zeroshard/sharding/layout.py,
`set_tensor_parallel`: tensor groups of consecutive ranks, data groups strided).

As in DeepSpeed 0.19.8, `get_data_parallel_*` (no underscore) are the tensor mesh's data
dimension, while `_get_data_parallel_*` (underscore) keep meaning the dense data-parallel
ranks of a run without an mpu. Before any tensor dimension is cut, the tensor group is this
rank alone (DeepSpeed asserts there; a group of one answers the same questions without one).
"""

from __future__ import annotations

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group
from zeroshard.sharding.layout import current_layout

__all__ = [
    "_init_tp_mesh_device",
    "get_tensor_model_parallel_group",
    "get_model_parallel_group",
    "get_data_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
]


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> None:
    """Cut the layout's tensor dimension (DeepSpeed's (dp, tp) mesh, tensor innermost); collective.
    A second call keeps the groups already cut, as DeepSpeed's does."""
    layout = current_layout()
    if layout.tensor is not None:
        return
    world = layout.world.size
    if data_parallel_size is not None and data_parallel_size * tensor_model_parallel_size != world:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_model_parallel_size={tensor_model_parallel_size} "
            f"!= world size {world}. Leave data_parallel_size out, or make the product the world size."
        )
    layout.set_tensor_parallel(tensor_model_parallel_size)


def _tensor() -> Group:
    layout = current_layout()
    return layout.tensor if layout.tensor is not None else comm.self_group(layout.world)


def get_tensor_model_parallel_group() -> Group:
    """This rank's tensor-parallel group (consecutive ranks)."""
    return _tensor()


def get_model_parallel_group() -> Group:
    """The model-parallel group: the tensor-parallel group (no pipeline dimension)."""
    return _tensor()


def get_data_parallel_group() -> Group:
    """The ranks holding the same tensor-parallel pieces (strided); the world without them."""
    layout = current_layout()
    return layout.tensor_data if layout.tensor_data is not None else layout.world


def get_tensor_model_parallel_world_size() -> int:
    return _tensor().size


def get_model_parallel_world_size() -> int:
    return _tensor().size


def get_tensor_model_parallel_rank() -> int:
    return _tensor().rank


def get_model_parallel_rank() -> int:
    return _tensor().rank


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of the first member of this rank's tensor-parallel group."""
    return _tensor().ranks[0]


def get_data_parallel_world_size() -> int:
    return get_data_parallel_group().size


def get_data_parallel_rank() -> int:
    return get_data_parallel_group().rank
