"""Side streams for stage 3's all-gathers and the gradient reductions, ordered by events.

[Note: streams and events]
On CUDA the collectives would otherwise run in order with compute (the current stream, or
NCCL's stream joined to it at every `wait()`), so a prefetched gather or a bucket's reduction
could not overlap the kernels around it. As FSDP2 does, the all-gathers run on a `gather`
stream and the reductions on a `reduce` stream, and events order them with compute:

* gather: the flat's full buffer is allocated on the compute stream, then the gather stream
  waits on an event recorded on the compute stream (after the allocation and after any
  optimizer write of the parameter shard it reads) before it writes the buffer; compute waits
  on the gather's completion event before anything reads the gathered parameters (before the
  unit's forward or backward, and before the buffer is freed).
* free: a gathered buffer belongs to the compute stream (allocated there), and its storage is
  released only after compute waited on the gather's completion event, so the gather stream
  never touches it again; the release itself is in compute-stream order after the buffer's
  last use. Hence no `record_stream` (whose deferred frees hold memory for an unknown time).
* reduce: the reduce stream waits on an event recorded on the compute stream after the
  gradient's producer (the division and the staging copy of the bucket), then issues the
  collective; when the reducer completes a bucket, compute waits on the reduction's event
  before anything reads the reduced shard (the result writes, the step) and before the
  bucket's buffers (allocated on the compute stream) are dropped.

Everything is gated on the flats' device being CUDA: elsewhere (CPU, gloo) `NULL_STREAMS`
makes every call a no-op and the engine runs exactly what it ran before. `RecordingStreams`
logs the calls so that tests check this ordering on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

GATHER, REDUCE, COMPUTE = "gather", "reduce", "compute"


class StreamSet:
    """No streams (CPU, gloo): every call is a no-op and every event None.

    `where` is "compute" (the current stream outside `on`), "gather" or "reduce"; `label`
    names the buffer or bucket concerned (only `RecordingStreams` reads it)."""

    @contextlib.contextmanager
    def on(self, where: str) -> Iterator[None]:
        """Run the block's kernels and collectives on the side stream `where`."""
        yield

    def record(self, where: str, label: str) -> object:
        """An event recorded on `where` now (what was queued there so far)."""
        return None

    def wait(self, where: str, event: object) -> None:
        """Make `where` wait for `event` before what is queued on it afterwards."""

    def released(self, label: str) -> None:
        """A gathered buffer's storage is released now (compute order: see the note above)."""


NULL_STREAMS = StreamSet()


class CudaStreams(StreamSet):
    """A gather stream and a reduce stream on `device`, beside its current (compute) stream.

    "compute" is the device's current stream when the call is made (always outside `on`), so
    a user who trains inside a stream of their own gets that one."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # High priority, as FSDP2 gives its communication streams: a collective ready to
        # go should not queue behind compute kernels.
        self._side = {
            GATHER: torch.cuda.Stream(device, priority=-1),
            REDUCE: torch.cuda.Stream(device, priority=-1),
        }

    def _stream(self, where: str) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self._device) if where == COMPUTE else self._side[where]

    @contextlib.contextmanager
    def on(self, where: str) -> Iterator[None]:
        with torch.cuda.stream(self._side[where]):
            yield

    def record(self, where: str, label: str) -> object:
        event = torch.cuda.Event()
        event.record(self._stream(where))
        return event

    def wait(self, where: str, event: object) -> None:
        if event is not None:
            self._stream(where).wait_event(event)


class RecordingStreams(StreamSet):
    """For tests: no streams, but every call is logged in `log` as a tuple:
    ("enter", where), ("exit", where), ("record", where, label), ("wait", where, label of the
    event's record) and ("released", label)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []

    @contextlib.contextmanager
    def on(self, where: str) -> Iterator[None]:
        self.log.append(("enter", where))
        try:
            yield
        finally:
            self.log.append(("exit", where))

    def record(self, where: str, label: str) -> object:
        self.log.append(("record", where, label))
        return (where, label)

    def wait(self, where: str, event: object) -> None:
        if event is not None:
            self.log.append(("wait", where, event[1]))

    def released(self, label: str) -> None:
        self.log.append(("released", label))


def streams_for(device: torch.device) -> StreamSet:
    """Real streams on a CUDA device, no-ops elsewhere."""
    if device.type == "cuda":
        return CudaStreams(device)
    return NULL_STREAMS
