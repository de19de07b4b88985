"""The writer thread: the training step hands events over and returns; files are written here.

A step only appends to a bounded queue (microseconds; see benchmarks/monitor_overhead.py). A
value may be a 0-d tensor still being computed on the accelerator: it is copied to host memory
without waiting (`HostScalar`), and this thread waits for the copy, so the step never
synchronises with the device for a monitor. When the queue is full (the disk cannot keep up)
new events are dropped and counted rather than stalling training; `close` reports the count.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from zeroshard.monitor.events import Event

logger = logging.getLogger("zeroshard")

# Batches of events (one per step); deep enough for minutes of a slow disk at small steps.
QUEUE_DEPTH = 4096
_CLOSE = object()


class Sink(Protocol):
    def write(self, events: Sequence[Event]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class HostScalar:
    """A 0-d accelerator tensor on its way to host memory; `value()` waits for the copy only."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor.detach().reshape(()), non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def value(self) -> float:
        self._ready.synchronize()
        return float(self._host)


def hand_over(value: Any) -> Any:
    """What the queue carries for `value`: numbers as they are, CPU tensors detached (read in the
    thread), accelerator tensors as a `HostScalar`."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cuda":
            return HostScalar(value)
        return value.detach()
    return value


def to_number(value: Any) -> float:
    if isinstance(value, HostScalar):
        return value.value()
    if isinstance(value, torch.Tensor):
        return float(value.float().mean()) if value.numel() != 1 else value.item()
    return value


class BackgroundWriter:
    """Runs the sinks' writes on one daemon thread, in the order the batches were put."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self._sinks = list(sinks)
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_DEPTH)
        self.dropped = 0
        self.error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="zeroshard-monitor", daemon=True)
        self._thread.start()

    def put(self, events: Sequence[Event]) -> None:
        if self._closed or self.error is not None:
            return
        batch = [(name, hand_over(value), int(samples)) for name, value, samples in events]
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += len(batch)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            try:
                if isinstance(item, threading.Event):  # a flush request
                    for sink in self._sinks:
                        sink.flush()
                    item.set()
                    continue
                events = [(name, to_number(value), samples) for name, value, samples in item]
                for sink in self._sinks:
                    sink.write(events)
            except BaseException as exc:  # noqa: BLE001 - reported at flush/close, training goes on
                if self.error is None:
                    self.error = exc
                    logger.error("monitor writer failed; no further events are written: %r", exc)
                if isinstance(item, threading.Event):
                    item.set()

    def flush(self, timeout: float | None = 60.0) -> None:
        """Wait until every event put so far is written and the sinks are flushed."""
        if self._closed or not self._thread.is_alive():
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Flush, stop the thread and close the sinks (once)."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join(timeout)
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - closing the others matters more
                logger.error("monitor close failed: %r", exc)
        if self.dropped:
            logger.warning("monitor: %d events dropped (the writer could not keep up)", self.dropped)
