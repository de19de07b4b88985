"""Each rank's progress record: the collectives zeroshard issued and the engine's calls around
them, kept for the hang watchdog (zeroshard/comm/watchdog.py).

[Note: the progress record]
zeroshard/comm/collectives.py notes every collective it puts on a transport (`issued`), waits
for it here (`wait`) and notes when it completed. Each entry carries where the engine was: the
step, the micro-step, the phase and the unit. The phase is the engine call running (forward,
evaluation, backward, step, save, load, init: `phase(...)`, which the engine wraps its calls
in), "backward" for anything issued inside an autograd graph task (whoever called backward),
"reduction" for the gradient reductions (tag "grad") and "other" outside any engine call. The
last RING_SIZE entries are kept, with the starts and ends of the engine's calls between them, so
that a diagnosis can show where each rank's sequence left the others'. What the watchdog
publishes every few seconds is only `snapshot()`: the latest entry, whether this rank waits in
it and since when, and how many collectives it issued on each channel.

Waiting happens here so that a rank blocked in a collective can be told that the job was
diagnosed as hung (`verdict`): on gloo the work is waited for in slices (`Work.wait(timeout)`
returns as soon as the work completes, and leaves it intact when the slice runs out), and
between slices the verdict is read. On NCCL `Work.wait()` only orders the current stream after
the collective (no host block), as before; with the watchdog on, a CUDA event recorded after it
tells the watchdog when the collective completed.

Everything here is per process (collectives are), written by the thread that issues
collectives and read by the watchdog's thread; the ring is copied under a lock.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import torch

from zeroshard.comm import faults

__all__ = ["RING_SIZE", "Entry", "Progress", "state", "phase", "wait", "engine_position", "bypassed"]

RING_SIZE = 512
# How long a gloo wait blocks before it looks at the verdict again: a completed collective
# returns at once, so this costs nothing unless the collective is stuck.
WAIT_SLICE = timedelta(seconds=0.25)
# NCCL collectives whose completion the watchdog has not seen yet; beyond this many the oldest
# (long completed in practice) are forgotten.
MAX_PENDING = 4096

# An engine call -> the name its collectives' phase takes ("evaluation": a forward with no grad
# or in eval mode).
CALLS = ("init", "forward", "evaluation", "backward", "step", "save", "load")

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@dataclass(slots=True)
class Entry:
    """One collective as this rank issued it.

    Attributes:
        seq: this rank's count of collectives so far (1 for the first), over every group.
        op, tag: the collective and what the engine used it for (zeroshard.comm.CollectiveRecord's).
        unit: the unit it belonged to, if any.
        numel: elements of the full buffer; None where ranks legitimately differ (an all-to-all
            with uneven splits, a pickled object).
        dtype: the wire dtype's name ("float32").
        group, group_size: its group's short name (channels.group_key: "0-3") and size.
        channel: the transport it ran on (zeroshard/comm/channels.py), index: its position there (1 = first).
        phase, step, micro_step: where the engine was (the note above).
        issued, waited, done: time.monotonic() when issued, when a wait for it began, when it completed.
    """

    seq: int
    op: str
    tag: str
    unit: str | None
    numel: int | None
    dtype: str
    group: str
    group_size: int
    channel: str
    index: int
    phase: str
    step: int | None
    micro_step: int | None
    issued: float
    waited: float | None = None
    done: float | None = None
    event: Any = None  # CUDA: recorded after the wait; complete when the collective is

    def fingerprint(self) -> tuple:
        """What must be equal on every rank for two ranks' seq-th collectives to pair (no
        rank-specific field: the group's size, not its ranks)."""
        return (self.op, self.tag, self.unit, self.numel, self.dtype, self.group_size, self.phase, self.step,
                self.micro_step)

    def public(self) -> dict[str, Any]:
        """JSON-ready, without the event."""
        out = asdict(self)
        out.pop("event")
        return out


class Progress:
    """This process's progress record (the module's `state`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ring: deque[Entry | tuple] = deque(maxlen=RING_SIZE)
        self.seq = 0
        self.issued_on: dict[str, int] = {}  # channel -> collectives issued on it
        self.calls: list[str] = []  # the engine calls running, outermost first
        self.step: int | None = None
        self.micro_step: int | None = None
        self.last: Entry | None = None
        self.waiting: Entry | None = None  # the collective a wait blocks in (gloo) now
        self.pending: deque[Entry] = deque()  # NCCL: waited for, completion not seen yet
        self.last_call: tuple[str, int | None, float] | None = None  # (call, step, ended at)
        self.steps_done = 0  # optimizer steps this process completed (the first step's grace)
        self.track_events = False  # NCCL with the watchdog on: record completion events
        self.failure: str | None = None  # a transport error a wait saw (the watchdog diagnoses it)
        self.verdict: str | None = None  # the diagnosis, once the watchdog has one
        self.delivered = False  # the verdict was raised on this rank already
        # Set by a running watchdog: given a failed collective's error text, waits a bounded
        # time for the diagnosis and returns it (None: no watchdog, or none came).
        self.failure_hook: Callable[[str], str | None] | None = None
        # False inside `bypassed()`: collectives go on their groups, unrecorded, waited plainly.
        self.enabled = True

    # ----------------------------------------------------------------- the engine
    def call_started(self, name: str, step: int | None, micro_step: int | None) -> None:
        self.raise_if_diagnosed(f"as it started {name}")
        if step is not None:
            self.step = step
        if micro_step is not None:
            self.micro_step = micro_step
        self.calls.append(name)
        self._mark(name, "start")

    def call_ended(self, name: str) -> None:
        if self.calls and self.calls[-1] == name:
            self.calls.pop()
        self._mark(name, "end")
        if not self.calls:
            self.last_call = (name, self.step, time.monotonic())

    def _mark(self, name: str, edge: str) -> None:
        with self.lock:
            self.ring.append(("call", name, edge, self.step, self.micro_step, time.monotonic(), self.seq))

    # ----------------------------------------------------------- the collectives
    def phase_now(self, tag: str) -> str:
        """The phase a collective issued now belongs to (the note above)."""
        if torch._C._current_graph_task_id() != -1:
            name = "backward"
        elif self.calls:
            name = self.calls[-1]
        else:
            return "other"
        return "reduction" if tag == "grad" and name in ("backward", "step") else name

    def channel_call(self) -> str | None:
        """The engine call that decides a collective's channel: "backward" inside an autograd
        graph task, else the outermost call running; None outside the engine."""
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return self.calls[0] if self.calls else None

    def issued(
        self, op: str, dtype: torch.dtype, numel: int | None, tag: str, group: str, group_size: int, channel: str
    ) -> Entry:
        """Note a collective about to be put on `channel` (`group`: its group's short name)."""
        self.raise_if_diagnosed(f"before its {op} '{tag}'")
        index = self.issued_on.get(channel, 0) + 1
        self.issued_on[channel] = index
        self.seq += 1
        entry = Entry(
            self.seq, op, tag, faults.where.unit, numel, dtype_name(dtype), group, group_size, channel, index,
            self.phase_now(tag), self.step, self.micro_step, time.monotonic(),
        )
        with self.lock:
            self.ring.append(entry)
        self.last = entry
        return entry

    def join_channel(self, channel: str) -> None:
        """This rank is a member of `channel` (its count starts at 0: the watchdog compares counts)."""
        self.issued_on.setdefault(channel, 0)

    def step_completed(self) -> None:
        self.steps_done += 1

    # ------------------------------------------------------------------ verdict
    def diagnose_failure(self, error: str) -> str | None:
        """A collective of this rank failed (`error`): the watchdog's diagnosis of the job, or None."""
        hook = self.failure_hook
        if hook is None:
            return None
        self.failure = error
        text = hook(error)
        if text is not None:
            self.delivered = True  # raised by the caller, with the collective's own name
        return text

    def raise_if_diagnosed(self, where: str = "outside zeroshard's collectives") -> None:
        """Raise the diagnosis once on this rank, when the watchdog has one (`where`: what this
        rank was doing, the message's first line)."""
        if self.verdict is not None and not self.delivered:
            self.delivered = True
            raise faults.HangError(f"the hang watchdog stopped this rank {where}.", self.verdict)

    # --------------------------------------------------------------- snapshots
    def ring_copy(self) -> list[Entry | tuple]:
        with self.lock:
            return list(self.ring)

    def completed_pending(self) -> None:
        """Drop the NCCL entries whose completion event has passed (the watchdog's thread)."""
        while self.pending:
            entry = self.pending[0]
            if entry.event is not None and not entry.event.query():
                return
            entry.done = time.monotonic()
            entry.event = None
            self.pending.popleft()

    def current(self) -> tuple[Entry | None, float | None]:
        """The collective this rank waits in and since when (monotonic), or (None, None)."""
        waiting = self.waiting
        if waiting is not None:
            return waiting, waiting.waited
        if self.pending:
            entry = self.pending[0]
            return entry, entry.waited
        return None, None


state = Progress()


@contextlib.contextmanager
def phase(name: str, step: int | None = None, micro_step: int | None = None) -> Iterator[None]:
    """The engine runs call `name` (one of CALLS) inside the block, at this step and micro-step."""
    state.call_started(name, step, micro_step)
    try:
        yield
    finally:
        state.call_ended(name)


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Inside the block collectives are neither recorded nor routed to channels and are waited
    for plainly, as before issue 37: only to measure what the record costs
    (benchmarks/interleaved.py's `-bare` engines). Every rank must bypass the same collectives."""
    previous, state.enabled = state.enabled, False
    try:
        yield
    finally:
        state.enabled = previous


def engine_position() -> tuple[int | None, int | None]:
    return state.step, state.micro_step


def wait(work: Any, entry: Entry | None, sliced: bool) -> None:
    """Wait for `work` (a torch Work) of the collective `entry`.

    `sliced` (gloo): in slices, raising `HangError` when the watchdog diagnosed a hang meanwhile.
    Any other backend: `work.wait()` once. Errors of the collective itself propagate."""
    p = state
    if work is None:
        return
    if not sliced:
        work.wait()
        if entry is not None:
            now = time.monotonic()
            entry.waited = now
            if p.track_events and torch.cuda.is_available():
                entry.event = torch.cuda.Event()
                entry.event.record()
                p.pending.append(entry)
                if len(p.pending) > MAX_PENDING:  # the watchdog drops completed ones each tick
                    p.pending.popleft()
            else:
                entry.done = now
        return
    if entry is not None:
        entry.waited = time.monotonic()
    previous, p.waiting = p.waiting, entry
    try:
        while True:
            try:
                work.wait(timeout=WAIT_SLICE)
                break
            except Exception:
                if work.is_completed():
                    # Completed meanwhile (this returns) or failed (this raises the collective's
                    # own error, which the caller names).
                    work.wait()
                    break
                p.raise_if_diagnosed("in a collective")
    finally:
        p.waiting = previous
    if entry is not None:
        entry.done = time.monotonic()
