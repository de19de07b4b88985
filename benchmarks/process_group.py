"""Process groups of the benchmarks: a group of one for a benchmark run alone
(benchmarks/muon_step.py, the GPU check: gloo on the CPU; NCCL for CUDA tensors, gloo beside it
for CPU ones, e.g. offloaded state, the device bound as zeroshard.init_distributed binds it), and
`close_group`, the safe end of any benchmark that made its own group.

Why the order matters: torch's DDP `Reducer`, FSDP2's modules and DeepSpeed's engine hold the
process group. Destroyed while one of them is alive, the group is freed later, by that object's
deallocation, at interpreter teardown or in a gc pass: the Reducer's destructor joins a gloo
worker thread while holding the GIL, and the worker waits for the GIL to free a tensor, a
deadlock (benchmarks/interleaved.py hung ten minutes at exit on a loaded machine). So every
engine and wrapper goes first, cycles are collected, and only then is the group destroyed,
which joins its workers with the GIL released ([Note: process-group lifetime] in
zeroshard/launch/distributed.py).
"""

from __future__ import annotations

import gc
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group_of_one(device: torch.device) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


# What holds a process group (or, for zeroshard's engine, hooks and buffers that should go first).
GROUP_HOLDERS = frozenset({
    "torch.nn.parallel.distributed.DistributedDataParallel",
    "torch.distributed.fsdp._fully_shard._fully_shard.FSDPModule",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "zeroshard.engine.engine.Engine",
})


def group_holders() -> list[str]:
    """Class names of the live objects that must be gone before the group is destroyed (after a
    full gc pass, so unreachable cycles do not count)."""
    gc.collect()
    found = []
    for obj in gc.get_objects():
        try:
            classes = type(obj).__mro__
        except AttributeError:
            continue
        if any(f"{c.__module__}.{c.__qualname__}" in GROUP_HOLDERS for c in classes):
            found.append(type(obj).__name__)
    return sorted(found)


def close_group() -> None:
    """Destroy the default process group once nothing holds it (see the module note). Call it
    after the engines, DDP and FSDP models are out of scope (keep them inside a function that
    returns only numbers); RuntimeError naming what is still alive otherwise, instead of a
    deadlock at exit."""
    alive = group_holders()
    if alive:
        raise RuntimeError(
            f"close_group: {', '.join(alive)} still alive; drop every engine and DDP/FSDP model (and the "
            "closures and loop variables that hold them) before destroying the process group."
        )
    dist.destroy_process_group()
