"""Process-group set-up from torchrun's environment, and its lifetime.

[Note: process-group lifetime]
The group must be destroyed, and actually freed, before the interpreter finalizes. Its
gloo worker threads execute the asynchronous collectives; one issued inside a backward (a
gradient reduction from an autograd hook) carries the thread-local state of torch's autograd
call, which holds a Python object (`_engine_run_backward` stashes the caller's
`contextvars.Context`). The worker that ran the collective may drop the last reference to it
just after `wait()` returned, and freeing that object needs the GIL. If the interpreter is
finalizing by then, CPython ends the worker thread inside a `noexcept` destructor and the
process aborts ("terminate called without an active exception", SIGABRT). Freeing the group
joins its worker threads (with the GIL released), so the group must be gone first:

- a group `init_distributed` creates is destroyed by an atexit handler (after the user's
  own code, before finalization, after a gc pass so that what only cycles keep, a dropped DDP
  model among them, is freed while the group exists), unless the user destroyed it already;
- an object that holds the group (torch's DDP Reducer, FSDP2 modules, DeepSpeed's engine) must be
  freed before the group is destroyed: freed after it, it frees the group in its own destructor
  while holding the GIL, and the gloo worker it joins may be waiting for the GIL (a deadlock at
  exit; benchmarks/process_group.py `close_group` checks this for the benchmarks);
- a group the user creates is the user's to destroy (`dist.destroy_process_group()` at the
  end of the script, as torch asks);
- `destroy_process_group` frees the group only if nothing else references it. torch's own
  `torch.distributed.nn.functional` captures `group.WORLD` in its default arguments when it
  is first imported, and torch imports it lazily (the first optimizer imports torch._dynamo,
  which imports FSDP, which imports it), often after the group exists: the group then
  outlives `destroy_process_group` and its threads live into finalization (ten references,
  one per collective; a group made by the user, Accelerate or Ray before `initialize` hit
  this, and CI's preinitialized-group run aborted at exit). `release_default_group_arguments`
  imports that module and puts None (which those functions read as the default group, as
  when the module is imported before any group exists) where a default holds a group; it
  runs at `import zeroshard`, at `initialize` and before zeroshard's atexit destroy, and a
  later import finds the module already loaded. zeroshard itself holds groups only through
  weak references (`comm.Group.handle_ref`), so an engine still alive at exit does not keep them.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from zeroshard.launch.device import binds_device_id, cuda_device_index, uses_nccl
from zeroshard.launch.launchers import discover_launch, export_launch


def release_default_group_arguments() -> None:
    """No default argument of `torch.distributed.nn.functional` holds a process group
    ([Note: process-group lifetime])."""
    if not dist.is_available():
        return
    import torch.distributed.nn.functional as functional

    for fn in vars(functional).values():
        defaults = getattr(fn, "__defaults__", None)
        if getattr(fn, "__module__", None) != functional.__name__ or not defaults:
            continue
        if any(isinstance(value, dist.ProcessGroup) for value in defaults):
            fn.__defaults__ = tuple(None if isinstance(value, dist.ProcessGroup) else value for value in defaults)


release_default_group_arguments()


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
    `zeroshard.launch.launchers`; a mapping that needs MASTER_ADDR is refused naming it). Without any
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
    # The group must be freed before the interpreter finalizes: see [Note: process-group lifetime].
    atexit.register(_destroy_if_initialized)


def _destroy_if_initialized() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    release_default_group_arguments()
    # What only a reference cycle keeps (a dropped engine, a user's DDP model: its Reducer holds
    # the group) goes now, while the group exists: freed after the destroy, a DDP model frees
    # the group inside its own destructor, which can deadlock with the gloo workers.
    gc.collect()
    world = dist.group.WORLD
    gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    # Freed here unless something else holds it (2: `world` and getrefcount's argument).
    if gloo and sys.getrefcount(world) > 2:
        warnings.warn(
            "zeroshard: the process group is still referenced after destroy_process_group, so its "
            "gloo worker threads live into interpreter shutdown, where they can abort the process "
            "('terminate called without an active exception'). Drop references to process groups "
            "(dist.group.WORLD, a DeviceMesh, FSDP modules) before the script ends.",
            RuntimeWarning,
            stacklevel=1,
        )
