"""The hang watchdog: one thread per process that publishes this rank's progress through the
rendezvous store and, when the ranks stop moving together, names where each one is on every
rank it can reach, well before `zeroshard.collective_timeout_s`.

[Note: the hang watchdog]
Store: the default group's own (torchrun's agent store, or the one `init_distributed` made; a
TCPStore gets a second client connection to the same server, `clone()`, so this thread never
queues behind a store wait of the main thread; no new port), under
`zeroshard/progress/<run>/<generation>/`. Every tick (`Timeouts.tick_s`: a sixteenth of
`hang_timeout_s`, at most 5 s) a rank writes its record (`rec/<rank>`, ~300 bytes: heartbeat,
state, the collective it waits in and for how long, its collectives per channel: see
zeroshard/comm/diagnosis.py) and reads one key (`status`). That is all a healthy job costs: two
small operations per rank per tick (4096 ranks at 5 s: ~1.6 k operations/s for the store;
benchmarks/watchdog_store.py measures 64 simulated ranks).

A rank that has waited in a collective for two ticks, or whose collective failed, offers to
decide (`decider`, a compare-and-set claim with a heartbeat: a stopped decider is replaced after
three ticks, and at least STALE_MIN_S). Only the decider reads every record, once per tick, and applies
`diagnosis.decide`: a certain deadlock (every rank waits, no awaited collective has been issued
by all of its transport's members, unchanged for a tick) or a mismatch is named at once; a rank
that waited longer than `hang_timeout_s` (in the process's first step, `hang_first_step_timeout_s`)
for ranks that never reached its collective is a hang (those ranks being stopped or dead, stuck
outside zeroshard, or still computing). The decider then asks one rank of each position for its
ring of recent collectives (`status` = "rings"), composes the diagnosis, stores it and sets
`status` = "diagnosed". Every watchdog that reads that status prints the text on its rank
(stderr) and sets `progress.state.verdict`: a rank waiting in a collective raises
`faults.HangError` from its wait within a quarter second; a rank elsewhere (its data loader)
gets a real-time signal whose handler raises it (from a sleep too); on NCCL the communicators are
aborted first, after the text is written, so a rank blocked in a device wait comes back to raise.
A rank whose collective failed (a peer's connection closed) waits a few ticks for the diagnosis
and raises it instead of the bare transport error.

gloo cannot cancel a collective in flight (`abort()` and `shutdown()` do not interrupt it,
measured on torch 2.13), so after a diagnosis the process cannot tear its groups down before
they time out: zeroshard's exit handler then leaves at once with status 1 (`os._exit`, after
flushing) instead of waiting up to `collective_timeout_s` in `destroy_process_group`.

Off (no thread) when `hang_timeout_s` is 0 and on any backend but gloo and NCCL (a simulated or
fake world moves no data: nothing waits); the progress record still records.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.comm import diagnosis, progress, simulated

__all__ = ["Timeouts", "resolve_timeouts", "start", "stop", "running", "BACKENDS"]

logger = logging.getLogger("zeroshard")

BACKENDS = ("gloo", "nccl")
DEFAULT_HANG_TIMEOUT_S = 300.0
# Ticks a waiting rank lets pass before it offers to decide; ticks without a new heartbeat
# after which a rank counts as stopped; ticks a failed collective waits for the diagnosis.
DECIDE_AFTER_TICKS = 1
STALE_TICKS = 3
# ... and at least this long: a busy machine can hold a healthy rank's thread back for a second.
STALE_MIN_S = 1.5
FAILURE_WAIT_TICKS = STALE_TICKS + 5
# The signal that interrupts a main thread outside zeroshard (a real-time one: no default use).
INTERRUPT_SIGNAL = getattr(signal, "SIGRTMIN", 34) + 6 if hasattr(signal, "pthread_kill") else None


@dataclass(frozen=True)
class Timeouts:
    """The watchdog's settings, resolved from the config (`resolve_timeouts`)."""

    hang_timeout_s: float
    first_step_timeout_s: float
    collective_timeout_s: float

    @property
    def enabled(self) -> bool:
        return self.hang_timeout_s > 0

    @property
    def tick_s(self) -> float:
        # A sixteenth of the timeout: a deadlock (four or five ticks) is named in under a third of
        # it. The 5 s cap sets the store's load at scale (any timeout from 80 s up: see the note).
        return min(5.0, max(0.2, self.hang_timeout_s / 16))

    def named(self) -> dict[str, float]:
        return {"hang_timeout_s": self.hang_timeout_s, "hang_first_step_timeout_s": self.first_step_timeout_s,
                "collective_timeout_s": self.collective_timeout_s}


def resolve_timeouts(
    hang_timeout_s: float | None, first_step_timeout_s: float | None, collective_timeout_s: float
) -> tuple[Timeouts, list[str]]:
    """The settings and the config problems (`<key>=<value>: <rule>. <fix>`).

    Unset, `hang_timeout_s` is 300 s, or half of `collective_timeout_s` when that is shorter
    than 600 s (so a test's timeout of a few seconds keeps the watchdog inside it); the first
    step's is halfway between `hang_timeout_s` and `collective_timeout_s`. Both must end before
    `collective_timeout_s`, the hard bound, or the watchdog could never speak first."""
    problems = []
    hang = min(DEFAULT_HANG_TIMEOUT_S, collective_timeout_s / 2) if hang_timeout_s is None else hang_timeout_s
    if hang >= collective_timeout_s:
        problems.append(
            f"zeroshard.hang_timeout_s={hang_timeout_s:g}: must be below zeroshard.collective_timeout_s "
            f"({collective_timeout_s:g}), the hard bound it diagnoses before. Lower it, raise "
            "zeroshard.collective_timeout_s, or set 0 to turn the watchdog off."
        )
    first = (hang + collective_timeout_s) / 2 if first_step_timeout_s is None else first_step_timeout_s
    if first_step_timeout_s is not None and hang > 0 and not hang <= first < collective_timeout_s:
        problems.append(
            f"zeroshard.hang_first_step_timeout_s={first_step_timeout_s:g}: must be at least "
            f"zeroshard.hang_timeout_s ({hang:g}) and below zeroshard.collective_timeout_s "
            f"({collective_timeout_s:g}). Pick a value between them, or leave it unset (halfway)."
        )
    return Timeouts(hang, first, collective_timeout_s), problems


def _raw_store() -> Any:
    """The default group's store without its prefixes; a TCPStore as a new client of its server."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        store = store.clone()
    return store


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), default=str).encode()


class Watchdog(threading.Thread):
    """The thread (see the note above). One per process and world: `start()` makes it."""

    def __init__(self, store: Any, rank: int, world_size: int, timeouts: Timeouts, backend: str) -> None:
        super().__init__(name="zeroshard-watchdog", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeouts = timeouts
        self.nccl = "nccl" in backend
        # Weakly: the thread must not keep the group alive past destroy_process_group
        # ([Note: process-group lifetime] in zeroshard/launch/distributed.py).
        world = dist.group.WORLD
        self.world = weakref.ref(world) if world is not None else (lambda: None)
        self.halt = threading.Event()
        self.hb = 0
        self.delivered = False
        self.rings_sent = False
        self.errors = 0
        self.waited_ticks = 0
        # The decider's view: rank -> (heartbeat, monotonic time it changed); the claim it saw.
        self.seen: dict[int, tuple[int, float]] = {}
        self.present: set[int] = set()
        self.claim_seen: tuple[bytes, float] | None = None
        self.my_claim: bytes | None = None
        self.last_positions: tuple | None = None
        self.deciding_since: float | None = None  # when this rank became the decider
        self.last_heartbeats: dict[int, int] = {}
        store.compare_set("status", "", "running")

    # --------------------------------------------------------------- the loop
    def run(self) -> None:
        try:
            self.tick()  # at once: a rank that stops early has still said where it was
        except Exception as exc:
            logger.warning("zeroshard watchdog: the rendezvous store failed (%s: %s)", type(exc).__name__, exc)
        while not self.halt.wait(self.timeouts.tick_s):
            if not dist.is_initialized() or dist.group.WORLD is not self.world():
                return  # the world this thread watched is gone
            try:
                self.tick()
                self.errors = 0
            except Exception as exc:  # the store went away (its host died), a race at exit
                self.errors += 1
                if self.errors in (1, 10):
                    logger.warning("zeroshard watchdog: the rendezvous store failed (%s: %s)", type(exc).__name__, exc)

    def tick(self) -> None:
        p = progress.state
        if self.nccl:
            p.completed_pending()
        self.hb += 1
        record = self.snapshot()
        self.store.set(f"rec/{self.rank}", _json(record))
        status = self.store.get("status")
        if status == b"diagnosed":
            self.deliver(self.store.get("diagnosis").decode())
            return
        if status.startswith(b"rings:") and not self.rings_sent:
            if str(self.rank) in status[6:].decode().split(","):
                ring = [e.public() if isinstance(e, progress.Entry) else list(e) for e in p.ring_copy()]
                self.store.set(f"ring/{self.rank}", _json(ring))
            self.rings_sent = True
        waiting = record["state"] in ("waiting", "failed")
        self.waited_ticks = self.waited_ticks + 1 if waiting else 0
        if waiting and (record["state"] == "failed" or self.waited_ticks > DECIDE_AFTER_TICKS):
            if self.claim():
                self.decide(status)
        elif self.my_claim is not None:  # no longer waiting: another rank decides if need be
            self.store.compare_set("decider", self.my_claim, b"")
            self.my_claim = self.deciding_since = None
            self.seen.clear()
            self.last_positions, self.last_heartbeats = None, {}

    def snapshot(self) -> dict[str, Any]:
        p = progress.state
        now = time.monotonic()
        entry, since = p.current()
        state = "failed" if p.failure else "waiting" if entry is not None else "inside" if p.calls else "outside"
        shown = entry if entry is not None else p.last
        last = p.last_call
        return {
            "rank": self.rank, "hb": self.hb, "state": state,
            "waited": None if entry is None or since is None else round(now - since, 3),
            "current": None if shown is None else shown.public(),
            "issued": p.issued_on.copy(), "calls": list(p.calls), "step": p.step, "micro": p.micro_step,
            "last_call": None if last is None else [last[0], last[1], round(now - last[2], 3)],
            "first_step": p.steps_done == 0, "failure": p.failure,
            "hang_timeout_s": self.timeouts.hang_timeout_s, "first_step_timeout_s": self.timeouts.first_step_timeout_s,
        }

    # ------------------------------------------------------------- deciding
    @property
    def stale_after_s(self) -> float:
        """A heartbeat unchanged this long means a stopped or dead rank."""
        return max(STALE_TICKS * self.timeouts.tick_s, STALE_MIN_S)

    def claim(self) -> bool:
        """Whether this rank is the decider (claiming the role, or taking it from a stopped one)."""
        mine = f"{self.rank}:{self.hb}".encode()
        expected = self.my_claim if self.my_claim is not None else b""
        now = self.store.compare_set("decider", expected, mine)
        if now == mine:
            self.my_claim = mine
            if self.deciding_since is None:
                self.deciding_since = time.monotonic()
            return True
        self.my_claim = self.deciding_since = None
        if self.claim_seen is None or self.claim_seen[0] != now:
            self.claim_seen = (now, time.monotonic())
            return False
        if time.monotonic() - self.claim_seen[1] > self.stale_after_s:
            taken = self.store.compare_set("decider", now, mine)  # the decider stopped: take over
            if taken == mine:
                self.my_claim = mine
                self.deciding_since = time.monotonic()
                return True
        return False

    def read_records(self) -> dict[int, dict | None]:
        missing = [r for r in range(self.world_size) if r not in self.present]
        for r in missing:
            if self.store.check([f"rec/{r}"]):
                self.present.add(r)
        ranks = sorted(self.present)
        values = self.store.multi_get([f"rec/{r}" for r in ranks]) if ranks else []
        records: dict[int, dict | None] = dict.fromkeys(range(self.world_size))
        for r, raw in zip(ranks, values, strict=True):
            records[r] = json.loads(raw)
        return records

    def staleness(self, records: dict[int, dict | None]) -> dict[int, float]:
        """Ranks whose heartbeat has not moved for STALE_TICKS ticks of this decider -> seconds."""
        now, stale = time.monotonic(), {}
        for r, rec in records.items():
            if rec is None:
                continue
            hb, since = self.seen.get(r, (None, now))
            if hb != rec["hb"]:
                self.seen[r] = (rec["hb"], now)
                continue
            if now - since > self.stale_after_s:
                stale[r] = now - since
        return stale

    def decide(self, status: bytes) -> None:
        records = self.read_records()
        stale = self.staleness(records)
        positions = tuple(
            (r, rec["state"], (rec["current"] or {}).get("seq")) for r, rec in sorted(records.items()) if rec
        )
        heartbeats = {r: rec["hb"] for r, rec in records.items() if rec}
        moved = all(heartbeats.get(r, -1) > hb for r, hb in self.last_heartbeats.items() if r not in stale)
        stable = positions == self.last_positions and moved and bool(self.last_heartbeats)
        self.last_positions, self.last_heartbeats = positions, heartbeats
        judged = time.monotonic() - (self.deciding_since or 0.0) > self.stale_after_s
        decision = diagnosis.decide(records, set(stale), stable, judged)
        if decision is None:
            return
        # One rank of each position sends its ring of recent collectives.
        reps = sorted({min(rs) for rs in diagnosis.by_position(records).values()} - set(stale))
        self.store.compare_set("status", status if status.startswith(b"rings:") else b"running",
                               b"rings:" + ",".join(map(str, reps)).encode())
        deadline = time.monotonic() + 2 * self.timeouts.tick_s + 1.0
        while time.monotonic() < deadline and not self.store.check([f"ring/{r}" for r in reps]):
            if self.rank in reps and not self.rings_sent:
                ring = [e.public() if isinstance(e, progress.Entry) else list(e) for e in progress.state.ring_copy()]
                self.store.set(f"ring/{self.rank}", _json(ring))
                self.rings_sent = True
            time.sleep(0.05)
        rings = {}
        for r in reps:
            if self.store.check([f"ring/{r}"]):
                rings[r] = json.loads(self.store.get(f"ring/{r}"))
        text = diagnosis.compose(decision, records, stale, rings, self.timeouts.named())
        self.store.set("diagnosis", text.encode())
        self.store.set("status", "diagnosed")
        self.deliver(text)

    # ------------------------------------------------------------- delivering
    def deliver(self, text: str) -> None:
        """Print the diagnosis on this rank and raise it on the main thread (see the note)."""
        if self.delivered:
            return
        self.delivered = True
        p = progress.state
        print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)
        p.verdict = text
        if self.nccl:
            _abort_nccl()
        # A main thread waiting in a collective raises it from there within a slice; one that
        # does not by then is elsewhere (its data loader, a device wait): interrupt it.
        deadline = time.monotonic() + 3 * progress.WAIT_SLICE.total_seconds()
        while not p.delivered and time.monotonic() < deadline:
            time.sleep(0.02)
        if not p.delivered and INTERRUPT_SIGNAL is not None and _interrupt_installed:
            signal.pthread_kill(threading.main_thread().ident, INTERRUPT_SIGNAL)

    def await_diagnosis(self, error: str) -> str | None:
        """A collective of this rank failed: the diagnosis within FAILURE_WAIT_TICKS ticks, or None."""
        deadline = time.monotonic() + FAILURE_WAIT_TICKS * self.timeouts.tick_s + self.stale_after_s + 1.0
        while time.monotonic() < deadline and self.is_alive():
            if progress.state.verdict is not None:
                return progress.state.verdict
            time.sleep(0.05)
        return progress.state.verdict


def _abort_nccl() -> None:
    """Abort every NCCL communicator (after the diagnosis is out: see the note)."""
    try:
        dist.distributed_c10d._abort_process_group(None)
    except Exception as exc:  # the group may be gone already
        logger.warning("zeroshard watchdog: aborting the NCCL communicators failed: %s", exc)


# ---------------------------------------------------------------- process-wide
_watchdog: Watchdog | None = None
_generation = 0
_interrupt_installed = False
_exit_registered = False


def _on_interrupt(signum, frame) -> None:
    p = progress.state
    p.raise_if_diagnosed("in a collective" if p.waiting is not None else "outside zeroshard's collectives")


def _install_interrupt() -> None:
    """The handler that raises the diagnosis on the main thread, unless the signal is taken."""
    global _interrupt_installed
    if _interrupt_installed or INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(INTERRUPT_SIGNAL) not in (signal.SIG_DFL, None):
        return  # someone else's: the diagnosis then raises at this rank's next collective
    signal.signal(INTERRUPT_SIGNAL, _on_interrupt)
    _interrupt_installed = True


def _exit_after_hang() -> None:
    """atexit: after a diagnosed hang, leave without tearing the groups down (see the note)."""
    stop()
    if progress.state.verdict is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def running() -> Watchdog | None:
    return _watchdog if _watchdog is not None and _watchdog.is_alive() else None


def start(timeouts: Timeouts, backend: str) -> Watchdog | None:
    """Start this process's watchdog for the current world (or give the running one these
    timeouts). None when it does not apply: disabled, no process group, a world of one, a
    backend other than gloo and NCCL, or a simulated world."""
    global _watchdog, _generation, _exit_registered
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    # A simulated world (zeroshard/comm/simulated.py) names gloo or NCCL as its backend but moves
    # no data and has no peer to publish to: nothing waits, nothing to watch.
    if not timeouts.enabled or not any(name in backend for name in BACKENDS) or simulated.is_simulated():
        stop()
        return None
    current = running()
    if current is not None and current.world() is dist.group.WORLD:
        current.timeouts = timeouts
        return current
    stop()
    _generation += 1
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = dist.PrefixStore(f"zeroshard/progress/{run}/{_generation}/", _raw_store())
    store.set_timeout(timedelta(seconds=max(30.0, 4 * timeouts.tick_s)))
    _watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), timeouts, backend)
    progress.state.track_events = _watchdog.nccl and torch.cuda.is_available()
    progress.state.failure_hook = _watchdog.await_diagnosis
    _install_interrupt()
    if not _exit_registered:
        atexit.register(_exit_after_hang)
        _exit_registered = True
    _watchdog.start()
    return _watchdog


def stop() -> None:
    """Stop the watchdog (if any) and wait for its thread."""
    global _watchdog
    dog, _watchdog = _watchdog, None
    if dog is None:
        return
    dog.halt.set()
    if dog.is_alive() and dog is not threading.current_thread():
        dog.join(timeout=10)
    progress.state.failure_hook = None
    progress.state.track_events = False
