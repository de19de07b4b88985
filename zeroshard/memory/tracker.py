"""Measuring what torch allocates on the CPU: the counterpart of `torch.cuda.max_memory_allocated`.

[Note: counting CPU allocations]
torch has no memory statistics for the CPU. What it has is c10's CPU memory reporter: while the
profiler runs with `profile_memory=True`, every allocation and free of the default CPU allocator
is reported as an event carrying the running total of live bytes. Two things make that total
trustworthy here:

* By default the reporter only counts on threads that are being profiled, so a tensor freed on
  another thread is never subtracted: gloo's worker threads drop the last reference to a
  collective's buffers now and then, and identical runs then disagreed by a bucket (0.66 MB on
  the `tiny` preset). c10's flag `caffe2_report_cpu_memory_usage` (an exported global of
  libc10) makes the reporter count every allocation and free on every thread; it is switched
  on once per process, through ctypes, and costs a hash-map update per allocation. The
  profiler's events (on the measuring thread) then carry the exact global count.
* The count starts when the flag is set: blocks allocated earlier are unknown to it and their
  frees are ignored. The count at the tracker's start is its zero: a block allocated before
  (and after the flag was set) and freed inside counts below it. So a measurement builds what
  it measures inside the tracker.

What it sees is every tensor storage of the default CPU allocator, including the workspaces that
kernels allocate internally (which a TorchDispatchMode, seeing only the outputs of operators,
cannot), and nothing else: not gloo's internal buffers, not Python objects, not pinned memory
(the CUDA host allocator). That is what `torch.cuda.max_memory_allocated` measures on a GPU, for
the CPU. The profiler makes the measured code several times slower; use it for measurement, not
for training.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

__all__ = ["AllocationTracker", "PhasePeak", "enable_cpu_memory_reporting"]

_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"
_PHASE_PREFIX = "zeroshard.memory:"
_ZERO_MARK = _PHASE_PREFIX + "__zero__"


def enable_cpu_memory_reporting() -> None:
    """Make c10's CPU memory reporter count on every thread (see the note above). Idempotent."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    ctypes.c_bool.in_dll(lib, _FLAG).value = True


@dataclass(frozen=True)
class PhasePeak:
    """One marked phase: the live bytes when it started and the most during it."""

    name: str
    start_bytes: int
    peak_bytes: int
    start_ns: int = 0
    end_ns: int = 0


@dataclass
class AllocationTracker:
    """Live CPU bytes over time, from what is allocated inside the `with` block.

    Usage::

        with AllocationTracker() as tracker:
            model = build()                     # counted: built inside
            with tracker.phase("step 1"):
                train_step(model)
        tracker.peak_bytes                      # the most bytes alive at once
        tracker.phases["step 1"].peak_bytes

    Phases may repeat a name; the last one wins. Values are bytes above what was alive when the
    tracker started (0 at its start; below 0 after freeing older memory).
    """

    series: list[tuple[int, int]] = field(default_factory=list)  # (time ns, live bytes)
    zero_bytes: int = 0  # the global count at the start (tracker values are above it)
    phases: dict[str, PhasePeak] = field(default_factory=dict)
    _profile: object = None
    _marks: list[tuple[str, int, int]] = field(default_factory=list)

    def __enter__(self) -> AllocationTracker:
        from torch.profiler import ProfilerActivity, profile, record_function

        enable_cpu_memory_reporting()
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        with record_function(_ZERO_MARK):
            torch.empty(1)  # its allocation event's total, less its size, is the zero
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(_PHASE_PREFIX + name):
            yield

    @staticmethod
    def live_bytes() -> int:
        """The count now: bytes alive that were allocated since the reporting was switched on
        (`enable_cpu_memory_reporting`), read through one allocation event."""
        with AllocationTracker() as probe:
            pass
        return probe.zero_bytes

    def __exit__(self, *exc_info: object) -> None:
        from torch._C._profiler import _EventType

        self._profile.__exit__(*exc_info)
        events, marks = [], []
        pending = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while pending:
            node = pending.pop()
            if node.tag == _EventType.Allocation:
                fields = node.extra_fields
                if fields.device.type == "cpu":
                    events.append((node.start_time_ns, fields.alloc_size, fields.total_allocated))
            elif node.tag == _EventType.TorchOp and node.name.startswith(_PHASE_PREFIX):
                marks.append((node.name[len(_PHASE_PREFIX):], node.start_time_ns, node.end_time_ns))
            pending.extend(node.children)
        self._profile = None
        events.sort(key=lambda e: e[0])
        if not events:
            return
        zero = events[0][2] - events[0][1]  # the probe's event: the count before it
        self.zero_bytes = zero
        self.series = [(t, total - zero) for t, _, total in events]
        for name, start, end in sorted(marks, key=lambda m: m[1]):
            if name != "__zero__":
                self.phases[name] = self._window(name, start, end)

    def _window(self, name: str, start: int, end: int) -> PhasePeak:
        before, peak = 0, None
        for t, live in self.series:
            if t < start:
                before = live
                continue
            if t > end:
                break
            peak = live if peak is None else max(peak, live)
        return PhasePeak(name, before, max(before, peak if peak is not None else before), start, end)

    @property
    def peak_bytes(self) -> int:
        """The most bytes alive at once while the tracker ran."""
        return max((live for _, live in self.series), default=0)

    @property
    def end_bytes(self) -> int:
        """Bytes still alive when the tracker stopped."""
        return self.series[-1][1] if self.series else 0
