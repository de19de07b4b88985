"""Process-group set-up from torchrun's environment."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import binds_device_id, cuda_device_index, uses_nccl
from .faults import DEFAULT_COLLECTIVE_TIMEOUT_S
from .launchers import discover_launch, export_launch


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(dist_backend: str | None = None, timeout: timedelta | float | None = None) -> None:
    """Create the default process group from torchrun's environment, once.

    `timeout` (a timedelta or seconds) is how long a collective waits for its peers before it
    fails with an error; None is zeroshard.collective_timeout_s's default, 10 minutes
    (`initialize` passes the config's value), not torch's 30.

    NCCL when a GPU is present, gloo otherwise. Under srun, mpirun or another PMI launcher
    without torchrun's variables, the launcher's are mapped to them first (see
    `zeroshard.launchers`; a mapping that needs MASTER_ADDR is refused naming it). Without any
    launcher nothing is created and the engine runs as a single process (world size 1).
    """
    if dist.is_initialized():
        return
    launch = discover_launch()  # torchrun's variables, or srun's / mpirun's mapped to them
    if launch is None:
        return
    export_launch(launch)
    backend = dist_backend or default_backend()
    if timeout is None:
        timeout = DEFAULT_COLLECTIVE_TIMEOUT_S
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    kwargs: dict = {"timeout": timeout}
    if uses_nccl(backend):
        index = cuda_device_index(launch.world_size)
        torch.cuda.set_device(index)
        if binds_device_id(launch.world_size):
            kwargs["device_id"] = torch.device("cuda", index)
    dist.init_process_group(backend=backend, **kwargs)
    # A process that exits with the group alive can abort in the backend's threads at
    # interpreter shutdown ("terminate called without an active exception"); the group
    # this function created is torn down at exit unless the user already did it.
    atexit.register(_destroy_if_initialized)


def _destroy_if_initialized() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
