"""Host memory of a process, and ranks spawned on this machine to measure it: shared by the
benchmarks that measure how much a model costs to build or load per rank
(zero_init_memory.py, hf_zero3_load.py).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> tuple[int, int]:
    """(resident bytes, anonymous resident bytes: resident minus file-backed/shared)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]) * PAGE, int(fields[2]) * PAGE
    return resident, resident - shared


class PeakSampler:
    """The highest RSS (`peak`) and anonymous RSS (`peak_anon`) seen between start() and stop(),
    sampled every `interval_s`."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = self.peak_anon = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        resident, anon = rss()
        self.peak, self.peak_anon = max(self.peak, resident), max(self.peak_anon, anon)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval_s)

    def start(self) -> PeakSampler:
        self._sample()
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker: Callable, world: int, args: tuple, name: str, timeout_s: float) -> list[dict]:
    """Run `worker(rank, world, port, *args, queue)` in `world` spawned processes and return the
    row each puts on the queue, by rank; raises if a worker fails."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    rows = [queue.get(timeout=timeout_s) for _ in procs]
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"{name}: a worker exited with {p.exitcode}")
    return sorted(rows, key=lambda r: r["rank"])
