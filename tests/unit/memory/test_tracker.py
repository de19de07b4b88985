"""AllocationTracker (zeroshard/memory/tracker.py) against byte arithmetic: what it reports is what
was allocated, also when another thread frees it."""

import threading

import torch

from zeroshard.memory import AllocationTracker, enable_cpu_memory_reporting

MIB = 2**20


def test_peak_and_phases_are_the_bytes_allocated_and_freed():
    holder: list[torch.Tensor] = []
    with AllocationTracker() as tracker:
        with tracker.phase("build"):
            a = torch.empty(MIB, dtype=torch.uint8)
            b = torch.empty(2 * MIB, dtype=torch.uint8)
        with tracker.phase("swap"):
            holder.append(torch.empty(MIB // 2, dtype=torch.uint8))
            del a  # 2.5 MiB alive
            c = torch.empty(MIB, dtype=torch.uint8)  # 3.5 MiB: the peak
            del c
        # A free on another thread (gloo's workers drop collective buffers that way) is counted.
        thread = threading.Thread(target=holder.clear)
        thread.start()
        thread.join()
        d = torch.empty(16, dtype=torch.uint8)
    del b, d
    assert tracker.phases["build"].peak_bytes == 3 * MIB
    assert tracker.phases["swap"].start_bytes == 3 * MIB
    assert tracker.phases["swap"].peak_bytes == 3 * MIB + MIB // 2
    assert tracker.peak_bytes == 3 * MIB + MIB // 2
    assert tracker.end_bytes == 2 * MIB + 16  # b and d: the thread's free was subtracted


def test_the_count_is_relative_to_its_start():
    enable_cpu_memory_reporting()  # from here on every block is known to the count
    before = torch.empty(4 * MIB, dtype=torch.uint8)
    with AllocationTracker() as tracker:
        with tracker.phase("free older"):
            del before  # alive at the start: freeing it goes below the zero
            x = torch.empty(MIB, dtype=torch.uint8)
    del x
    assert tracker.end_bytes == -3 * MIB
    assert tracker.phases["free older"].peak_bytes == 0  # the start, nothing above it
