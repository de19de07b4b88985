"""Process-group set-up from torchrun's environment."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(dist_backend: str | None = None, timeout: timedelta | None = None) -> None:
    """Create the default process group from torchrun's environment, once.

    NCCL when a GPU is present, gloo otherwise. Without torchrun's environment variables
    nothing is created and the engine runs as a single process (world size 1).
    """
    if dist.is_initialized():
        return
    if not launched_by_torchrun():
        return
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend=backend, **kwargs)
