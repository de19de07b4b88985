"""The device a process trains on: `cuda:LOCAL_RANK % device_count()`, whoever launched it.

Who created the process group does not matter (zeroshard's `init_distributed`, the user, a
trainer, `dist_init_required=False`, a `"cpu:gloo,cuda:nccl"` backend): every rank picks its
GPU from its local rank and makes it the current device, so no two ranks of a machine
compute on GPU 0 by accident. A process group whose collectives for CUDA tensors are gloo's
(a plain `"gloo"` group) means CPU training; a model the user already put on a GPU is
refused there, since the collectives zeroshard needs do not run on CUDA tensors under gloo.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.launch.launchers import launcher_local_rank

# Backends whose collectives do not take CUDA tensors (reduce-scatter in particular).
_NO_CUDA_COLLECTIVES = ("gloo",)


def backends_by_device(backend: str) -> dict[str, str]:
    """{"cpu": "gloo", "cuda": "nccl"} for "cpu:gloo,cuda:nccl"; a bare name serves every
    device it supports, so "nccl" is {"cuda": "nccl"} and "gloo" {"cpu": "gloo", "cuda": "gloo"}."""
    backend = backend.lower()
    if ":" in backend:
        pairs = (part.split(":", 1) for part in backend.split(",") if part)
        return {device.strip(): name.strip() for device, name in pairs}
    if backend == "nccl":
        return {"cuda": "nccl"}
    return {"cpu": backend, "cuda": backend}


def uses_nccl(backend: str) -> bool:
    """Whether a backend string (as given to init_process_group) runs CUDA collectives on NCCL."""
    return backends_by_device(backend).get("cuda") == "nccl"


def binds_device_id(world_size: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether init_distributed passes `device_id` to an NCCL init_process_group.

    Binding tells NCCL each rank's GPU up front (without it barriers guess the GPU from the
    rank and warn that a wrong guess hangs). As DeepSpeed does since its fix for one-process
    jobs (new_group after binding failed with CUDA error 600 there), a world of one is not
    bound. ZEROSHARD_NCCL_DEVICE_ID=0 turns binding off: some torch releases hung with bound
    groups plus further NCCL groups (DeepSpeed and open-instruct reports, torch 2.6-2.7).
    """
    environ = os.environ if environ is None else environ
    setting = environ.get("ZEROSHARD_NCCL_DEVICE_ID", "").strip().lower()
    if setting in ("0", "false", "no", "off"):
        return False
    if setting not in ("", "1", "true", "yes", "on"):
        raise ValueError(f"ZEROSHARD_NCCL_DEVICE_ID={setting!r}: must be 0 or 1. Unset it for the default.")
    return world_size > 1 or setting != ""


def group_cuda_backend() -> str | None:
    """The default process group's backend for CUDA tensors; None without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    get_config = getattr(dist, "get_backend_config", None)
    described = get_config() if get_config is not None else dist.get_backend()
    return backends_by_device(str(described)).get("cuda")


def cuda_device_index(world_size: int = 1) -> int:
    """The GPU of this process: LOCAL_RANK (or srun's / mpirun's local rank when LOCAL_RANK is
    not set) modulo the visible GPUs.

    Without LOCAL_RANK a single process keeps the current device (the user's
    `torch.cuda.set_device` or CUDA_VISIBLE_DEVICES); several processes on a machine with
    several GPUs cannot tell which is theirs, and are refused.
    """
    count = torch.cuda.device_count()
    if count < 1:
        raise RuntimeError("CUDA reports no visible device. Check CUDA_VISIBLE_DEVICES.")
    rank = launcher_local_rank()
    if rank is None:
        if world_size <= 1:
            return torch.cuda.current_device()
        if count > 1:
            raise RuntimeError(
                f"LOCAL_RANK is not set: with {world_size} processes and {count} GPUs on this machine "
                "each process cannot tell which GPU is its own. Launch with torchrun or `zeroshard "
                "launch` (they set LOCAL_RANK), or set LOCAL_RANK to the process's index on its machine."
            )
        return 0
    return rank % count


def _model_on_cuda(model: nn.Module | None) -> torch.device | None:
    if model is None:
        return None
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "cuda":
            return tensor.device
    return None


def select_device(model: nn.Module | None = None) -> torch.device:
    """The device to train on, made current: `cuda:LOCAL_RANK % device_count()` when CUDA is
    available and the process group (if any) has CUDA collectives, the CPU otherwise.

    Raises:
        RuntimeError: `model` is on a GPU but the process group is gloo-only.
    """
    cuda_backend = group_cuda_backend()
    if cuda_backend in _NO_CUDA_COLLECTIVES:
        placed = _model_on_cuda(model)
        if placed is not None:
            raise RuntimeError(
                f"the model is on {placed} but the process group's backend is "
                f"{dist.get_backend()!r}, which has no reduce-scatter for CUDA tensors. Create the "
                "group with backend 'nccl' or 'cpu:gloo,cuda:nccl' (zeroshard.init_distributed does "
                "when a GPU is present), or keep the model on the CPU."
            )
        if torch.cuda.is_available():
            warnings.warn(
                f"training on the CPU although CUDA is available: the process group's backend is "
                f"{dist.get_backend()!r}. Use 'nccl' or 'cpu:gloo,cuda:nccl' to train on the GPUs.",
                stacklevel=2,
            )
        return torch.device("cpu")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    world_size = dist.get_world_size() if cuda_backend is not None else 1
    index = cuda_device_index(world_size)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def move_to_device(item: Any, device: torch.device | str, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """DeepSpeed's `deepspeed.runtime.utils.move_to_device`: `item` (a tensor, or lists, tuples
    and dicts of them) on `device`. With `criterion_func`, a value it accepts is moved in place
    (its `.data` replaced, so references to it see the move); without, every leaf is `.to(device)`."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device)
