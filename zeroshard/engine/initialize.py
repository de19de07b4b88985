"""`initialize`: DeepSpeed's entry point, `deepspeed.initialize`. It resolves the config for
the world, cuts the process's parallel layout for it and builds the engine. The package root
re-exports it as `zeroshard.initialize`; the demo and the tools call it from here, below the
root (docs/design.md, "The floors").

The imports of the engine and the config pass are inside the function so that
`import zeroshard` stays light.
"""

from __future__ import annotations

from typing import Any

from zeroshard.comm import collectives, progress
from zeroshard.comm.deepspeed_api import init_distributed
from zeroshard.launch.distributed import release_default_group_arguments

__all__ = ["initialize"]


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: Any = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
):
    """Wrap `model` for ZeRO training, as `deepspeed.initialize` does.

    `mesh_param=(dp, sp)` asks for data x sequence parallelism, as DeepSpeed's does: the same as
    the config's `data_parallel_size` and `sequence_parallel_size` (they must agree if both are given).

    Returns:
        (engine, optimizer, training_dataloader, lr_scheduler); the dataloader is None
        without `training_data`, the scheduler None when neither given nor configured.
    """
    from zeroshard.autotp.model_init import merge_recorded_tp_model_init
    from zeroshard.config.error import DeepSpeedConfigError
    from zeroshard.config.schema import requested_collective_timeout_s
    from zeroshard.engine.engine import Engine
    from zeroshard.resolve import resolve_config
    from zeroshard.sharding.layout import establish

    if model is None:
        raise ValueError("initialize: model= is required.")
    if mpu is not None and not hasattr(mpu, "get_sequence_parallel_group"):
        raise ValueError(
            "initialize: mpu= must be a sequence-parallel mpu (get_sequence_parallel_group(), ...; e.g. "
            "zeroshard.runtime.sequence_parallel.parallel_state_sp): tensor and pipeline parallelism are not "
            "supported by zeroshard."
        )
    raw = config if config is not None else config_params
    if raw is None and args is not None:
        raw = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if raw is None:
        raise DeepSpeedConfigError(
            "no config: pass config= (a dict or a JSON file path) or args with --deepspeed_config."
        )
    if dist_init_required is not False:
        # Before the config is resolved (the batch triangle needs the world size): the
        # timeout is read from the raw config here and validated with the rest below.
        init_distributed(timeout=requested_collective_timeout_s(raw))
    # A group made before zeroshard (the user's, Accelerate's, Ray's) must still be freed by its
    # destroy_process_group: [Note: process-group lifetime] in zeroshard/launch/distributed.py.
    release_default_group_arguments()
    if mesh_param is not None:
        raw = _with_mesh(raw, mesh_param, mpu, collectives.world_size())
    # deepspeed.tp_model_init's record (the Trainer's): merged into tensor_parallel, then dropped.
    raw = merge_recorded_tp_model_init(raw, mpu)
    mpu_sp = None if mpu is None else mpu.get_sequence_parallel_world_size()
    cfg = resolve_config(raw, world_size=collectives.world_size(), sequence_parallel_size=mpu_sp)
    if mpu is not None and cfg.tensor_parallel.size > 1:
        raise DeepSpeedConfigError(
            f"tensor_parallel.autotp_size={cfg.tensor_parallel.autotp_size} with a sequence-parallel mpu: tensor and "
            "sequence parallelism together are not supported by zeroshard. Use one of them."
        )
    # The process's one layout (zeroshard/sharding/layout.py), perhaps created already by an MoE
    # layer or parallel_state_sp: cut for this config, then handed to everything below.
    layout = establish(cfg.zeroshard.shard_group_size, cfg.zeroshard.collective_timeout_s)
    layout.set_sequence_parallel(*(_sequence_parallel_groups(mpu, cfg.sequence_parallel_size) or (None, None)))
    with progress.phase("init", 0, 0):  # its collectives in the progress record (zeroshard/comm/progress.py)
        layout.set_tensor_parallel(cfg.tensor_parallel.size, cfg.zeroshard.collective_timeout_s)
        engine = Engine(
            model, cfg, optimizer=optimizer, model_parameters=model_parameters,
            lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn, layout=layout,
        )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _with_mesh(raw: Any, mesh_param: Any, mpu: Any, world_size: int) -> dict:
    """The config with `mesh_param=(dp, sp)` written into its data and sequence-parallel sizes."""
    import os
    from pathlib import Path

    from zeroshard.config.error import DeepSpeedConfigError
    from zeroshard.config.file import read_config_file

    ok = (
        isinstance(mesh_param, (tuple, list)) and len(mesh_param) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh_param)
    )
    if not ok:
        raise DeepSpeedConfigError(
            f"mesh_param={mesh_param!r}: must be (data_parallel_size, sequence_parallel_size), two positive integers."
        )
    dp, sp = mesh_param
    if mpu is not None:
        raise DeepSpeedConfigError(
            "initialize: pass either mpu= or mesh_param=, not both: each gives the sequence-parallel groups."
        )
    if dp * sp != world_size:
        raise DeepSpeedConfigError(
            f"mesh_param=({dp}, {sp}): data_parallel_size x sequence_parallel_size = {dp * sp}, but {world_size} "
            f"ranks run. Launch {dp * sp} ranks, or pick sizes whose product is {world_size}."
        )
    data = dict(read_config_file(Path(raw)) if isinstance(raw, (str, os.PathLike)) else raw)
    for key, value in (("data_parallel_size", dp), ("sequence_parallel_size", sp)):
        if key in data and data[key] != value:
            raise DeepSpeedConfigError(
                f"{key}={data[key]} in the config, but mesh_param gives {value}. Make them agree, or drop one."
            )
        data[key] = value
    return data


def _sequence_parallel_groups(mpu: Any, size: int) -> tuple[collectives.Group, collectives.Group] | None:
    """(sequence group, data group): the mpu's, or for the config's `sequence_parallel_size`
    parallel_state_sp's (built here if needed); None without sequence parallelism."""
    from zeroshard.groups.sequence import set_sequence_parallel_mpu
    from zeroshard.sequence import parallel_state_sp

    if mpu is None and size > 1:
        if not parallel_state_sp.is_initialized():
            parallel_state_sp.initialize_sequence_parallel(size)
        elif parallel_state_sp.get_sequence_parallel_world_size() != size:
            raise ValueError(
                f"sequence_parallel_size={size}, but parallel_state_sp is initialized with "
                f"{parallel_state_sp.get_sequence_parallel_world_size()}. Pass that mpu, or make them agree."
            )
        mpu = parallel_state_sp
    set_sequence_parallel_mpu(mpu)
    if mpu is None or size == 1:
        return None
    sequence = collectives.as_group(mpu.get_sequence_parallel_group())
    if hasattr(mpu, "get_data_parallel_group"):
        data = collectives.as_group(mpu.get_data_parallel_group())
    else:  # the strided ranks at this rank's position in every sequence group
        data = parallel_state_sp.sequence_parallel_layout().data
    return sequence, data
