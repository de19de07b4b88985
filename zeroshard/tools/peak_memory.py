"""The peak memory of a block of code: on the device (allocated and reserved) and on the host.

    with PeakMemory(torch.device("cpu")) as peak:
        build_and_train()
    peak.device_allocated, peak.device_reserved, peak.host

* CUDA: the caching allocator's own peaks (`max_memory_allocated`, `max_memory_reserved`),
  reset on entry.
* CPU: there is no caching allocator to ask, so the allocations are counted from torch's
  profiler, which reports every allocation and free of c10's CPU allocator (tensors, autograd's
  buffers, storage resizes) with its size: the peak is the highest running sum over the block,
  plus the bytes of the tensors alive on entry. Reserved equals allocated (nothing is cached).
  What a communication library allocates inside a collective (gloo's temporary copy of an
  all-gather's output) is left out, as NCCL's buffers are outside torch's CUDA allocator: both
  devices count the tensors of the engine. Python's cyclic garbage collector is paused for the
  block (garbage is collected on entry): a collection mid-block runs at a moment set by object
  counts, and on gloo it moved the peak of identical runs by one gradient bucket (4 ranks on 2
  cores; tests/dist/tools/test_simulate_validation.py), so the peak measured is the engine's own
  allocation pattern. The profiler slows the block down: time a block without it.
* host: the process's resident-set high-water mark (VmHWM), reset on entry where Linux allows
  it (/proc/self/clear_refs), otherwise the whole process's (getrusage).
"""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["PeakMemory", "live_tensor_bytes"]


def live_tensor_bytes(device_type: str = "cpu") -> int:
    """Bytes of every distinct storage a live tensor on `device_type` holds (a parameter's
    .grad included), each storage once."""
    from torch._subclasses.fake_tensor import is_fake

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if _is_tensor(obj)]
    for obj in objects:
        for t in (obj, getattr(obj, "grad", None)) if isinstance(obj, torch.nn.Parameter) else (obj,):
            if t is None or t.device.type != device_type or is_fake(t):
                continue
            try:
                storage = t.untyped_storage()
                pointer = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                # A fake or functional tensor (another part of the process traced on fake
                # tensors: issue 39's memory plan, torch.compile) or a wrapper subclass: no bytes
                # of its own; a wrapper's inner tensors are counted as tensors themselves.
                continue
            seen[pointer] = max(seen.get(pointer, 0), storage.nbytes())
    return sum(seen.values())


def _is_tensor(obj: Any) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:
        return False


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Starting and stopping torch's profiler prints a line each from C++ (Kineto's
    "profiler_start" / "profiler_stop") straight to file descriptor 2: hidden for those calls."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _reset_host_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size (Linux 4.0+)
        return True
    except OSError:
        return False


def _host_peak(reset_worked: bool) -> int:
    if reset_worked:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Context manager measuring peaks on `device` and the host over its block."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.device_allocated = self.device_reserved = self.host = 0
        self.baseline = 0  # device bytes already allocated on entry (counted in the peaks)
        self._profiler: Any = None
        self._host_reset = False

    def __enter__(self) -> PeakMemory:
        self._host_reset = _reset_host_peak()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline = live_tensor_bytes("cpu")  # collects garbage first
            self._gc_was_enabled = gc.isenabled()
            gc.disable()
            # The autograd profiler: torch.profiler.profile would import torch's compiler stack
            # (seconds) to prepare a trace that is not needed here.
            self._profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
            with _quiet_stderr():
                self._profiler.__enter__()
            # Names this thread in the profile: its allocations are the block's (see _peak_of).
            self._mark = torch.profiler.record_function(_MARK)
            self._mark.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.device_allocated = torch.cuda.max_memory_allocated(self.device)
            self.device_reserved = torch.cuda.max_memory_reserved(self.device)
        else:
            self._mark.__exit__(*exc_info)
            with _quiet_stderr():
                self._profiler.__exit__(*exc_info)
            if self._gc_was_enabled:
                gc.enable()
            if exc_info[0] is None:
                self.device_allocated = self.baseline + _peak_of(self._profiler)
                self.device_reserved = self.device_allocated
            self._profiler = None
        self.host = _host_peak(self._host_reset)


# Record functions of a communication library's collectives: what is allocated inside them is
# the library's own (gloo copies an all-gather through a temporary of the output's size), not
# the engine's. So is what its worker threads allocate. NCCL's buffers are not in torch's CUDA
# allocator either, so both devices count the same thing: the engine's tensors.
_COLLECTIVE_SCOPES = ("c10d::", "gloo:", "nccl:")
_MARK = "zeroshard.peak_memory"


def _peak_of(profiler: Any) -> int:
    """The highest running sum of the CPU allocator's allocations and frees the profiler saw on
    the measuring thread (the block's own; CPU autograd runs there too), leaving out what a
    communication library allocated, inside a collective or on its own threads (and the frees
    of those buffers, matched by address, wherever they happen)."""
    from torch._C._profiler import _EventType

    roots = profiler.kineto_results.experimental_event_tree()
    own_thread = next((root.start_tid for root in roots if root.name == _MARK), None)
    events: list[tuple[int, int, int, bool]] = []  # (time, ptr, bytes, the library's)

    def walk(node: Any, inside: bool) -> None:
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                library = inside or (own_thread is not None and node.start_tid != own_thread)
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, library))
            return
        inside = inside or node.name.startswith(_COLLECTIVE_SCOPES)
        for child in node.children:
            walk(child, inside)

    for root in roots:
        walk(root, False)
    library: dict[int, bool] = {}  # address -> whether the live block there is the library's
    engine: dict[int, int] = {}  # address -> bytes of the engine's live block there
    running = peak = 0
    for _, ptr, nbytes, by_library in sorted(events, key=lambda e: e[0]):
        if nbytes > 0:
            # A new block at an address still live: its free was not seen (freed by a thread
            # the profiler did not follow), so the old block is gone.
            running -= engine.pop(ptr, 0)
            library[ptr] = by_library
            if by_library:
                continue
            engine[ptr] = nbytes
        elif library.pop(ptr, False):
            continue
        else:
            engine.pop(ptr, None)
        running += nbytes
        peak = max(peak, running)
    return peak
