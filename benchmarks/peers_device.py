"""Where a benchmark runs: the CPU with gloo (the default) or CUDA with NCCL (`--device cuda`).

On CUDA every rank uses cuda:LOCAL_RANK with an NCCL group bound to it, the batches live on
the GPU, timed regions end with `torch.cuda.synchronize()` (kernels run asynchronously, so a
host timer alone would time the launches), phases inside a step are CUDA events (no extra
synchronisation that would change the step), and each rank reports
`torch.cuda.max_memory_allocated()` and `max_memory_reserved()`.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch
import torch.distributed as dist

DEVICES = ("cpu", "cuda")


def check_device(device: str, world_size: int) -> str | None:
    """Why `device` cannot run `world_size` ranks here, or None."""
    if device not in DEVICES:
        return f"--device {device}: use one of {', '.join(DEVICES)}."
    if device == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            return (f"--device cuda: no CUDA device is available (torch {torch.__version__}, {build}). "
                    "Run on a GPU machine with a CUDA build of torch, or use --device cpu.")
        if torch.cuda.device_count() < world_size:
            return (f"--device cuda --world-size {world_size}: only {torch.cuda.device_count()} GPU(s) visible; "
                    "use at most one rank per GPU.")
    return None


def init_group(device: str, rank: int | None = None, world_size: int | None = None,
               init_method: str | None = None) -> torch.device:
    """Create the default group for `device` (NCCL bound to cuda:LOCAL_RANK, or gloo); the device."""
    kwargs: dict[str, Any] = {}
    if rank is not None:
        kwargs.update(rank=rank, world_size=world_size, init_method=init_method)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank or 0))
        torch.cuda.set_device(local)
        where = torch.device("cuda", local)
        # Bound to the GPU for several ranks only, as zeroshard.init_distributed does.
        ranks = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
        dist.init_process_group("nccl", **({"device_id": where} if ranks > 1 else {}), **kwargs)
        return where
    dist.init_process_group("gloo", **kwargs)
    return torch.device("cpu")


def local_device(device: str) -> torch.device:
    """The device of a process that makes no group (the floor): cuda:0 or the CPU."""
    if device == "cuda":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device, enabled: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on the device's type (the "autocast" mode)."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


class PhaseClock:
    """Marks inside a step and the seconds between them: host time on the CPU, CUDA events
    (read after the step's final synchronize) on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def memory_stats(device: torch.device) -> dict[str, int]:
    """This rank's CUDA allocator peaks (empty on the CPU)."""
    if device.type != "cuda":
        return {}
    return {"cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_memory_reserved_bytes": torch.cuda.max_memory_reserved(device)}
