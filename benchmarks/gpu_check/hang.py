"""Check g: the hang watchdog on this device's backend, at world 1 plus a simulated peer.

    python -m benchmarks.gpu_check.hang --device cuda     # NCCL (and gloo for the host), world 1
    python -m benchmarks.gpu_check.hang --device cpu      # gloo

A process group of one has no peer to wait for, so the peer is simulated: a thread publishes
rank 1's progress record into the real rendezvous store (alive, outside zeroshard since its last
step), and this rank's stand-in collective never completes: on CUDA a long `torch.cuda._sleep`
kernel with the completion event NCCL collectives get (zeroshard/comm/progress.py), waited for
by the watchdog's event queries; on the CPU a gloo-style work waited for in slices. The real
watchdog (zeroshard/comm/watchdog.py) then has to diagnose the hang, store and print the text,
on CUDA abort the NCCL communicators only after that (the real `_abort_process_group`), and
raise `HangError` on the main thread. Prints one JSON line: what happened, in order, and how long
after the stand-in collective started. Run in a process of its own (the abort ends its group).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import torch
import torch.distributed as dist

from benchmarks.process_group import init_group_of_one
from zeroshard.comm import faults, progress, watchdog

HANG_TIMEOUT_S = 1.0


class _StuckWork:
    """A gloo-like work that never completes: `wait(timeout)` times out every slice."""

    def wait(self, timeout=None):
        time.sleep(timeout.total_seconds() if timeout is not None else 3600)
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


def _simulated_peer(store, stop: threading.Event, tick: float) -> None:
    """Rank 1: alive (its heartbeat moves), outside zeroshard since its last step ended."""
    hb, started = 0, time.monotonic()
    while not stop.is_set():
        hb += 1
        store.set("rec/1", json.dumps({
            "rank": 1, "hb": hb, "state": "outside", "waited": None, "current": None,
            "issued": {name: 0 for name in progress.state.issued_on}, "calls": [], "step": 3, "micro": 3,
            "last_call": ["step", 3, round(time.monotonic() - started, 3)], "first_step": False, "failure": None,
            "hang_timeout_s": HANG_TIMEOUT_S, "first_step_timeout_s": HANG_TIMEOUT_S,
        }))
        stop.wait(tick)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    init_group_of_one(device)
    nccl = device.type == "cuda"
    events: list[tuple[str, float]] = []
    started = time.monotonic()

    def note(what: str) -> None:
        events.append((what, round(time.monotonic() - started, 3)))

    timeouts = watchdog.Timeouts(HANG_TIMEOUT_S, HANG_TIMEOUT_S, 60.0)
    store = dist.PrefixStore("zeroshard/progress/gpu-check/", watchdog._raw_store())
    real_abort = watchdog._abort_nccl

    def abort() -> None:
        note("abort" + (" after the diagnosis was stored" if store.check(["diagnosis"]) else " BEFORE the diagnosis"))
        real_abort()

    watchdog._abort_nccl = abort
    dog = watchdog.Watchdog(store, 0, 2, timeouts, "nccl" if nccl else "gloo")
    progress.state.track_events = nccl
    progress.state.failure_hook = dog.await_diagnosis
    watchdog._install_interrupt()
    stop = threading.Event()
    peer = threading.Thread(target=_simulated_peer, args=(store, stop, timeouts.tick_s), daemon=True)
    peer.start()
    channel = "step@0-1"
    progress.state.join_channel(channel)
    with progress.phase("step", 4, 4):
        entry = progress.state.issued("all_reduce", torch.float32, 8, "norm", "0-1", 2, channel)
        error = None
        dog.start()
        try:
            if nccl:
                torch.cuda._sleep(int(60 * 1e9))  # ~60 s of device time at ~1 GHz: the collective that hangs
                progress.wait(_DoneWork(), entry, sliced=False)  # records its completion event after the kernel
                note("waiting on the device")
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    time.sleep(0.05)  # the host goes on (NCCL's wait does not block it); the signal raises here
            else:
                progress.wait(_StuckWork(), entry, sliced=True)
        except faults.HangError as exc:
            error = exc
            note("HangError raised on the main thread")
    stop.set()
    dog.halt.set()
    text = error.diagnosis if error is not None else ""
    result = {
        "device": str(device), "backend": "nccl" if nccl else "gloo", "events": events,
        "raised": error is not None, "named_peer": "rank 1 is alive but outside zeroshard" in text,
        "named_collective": "all_reduce 'norm'" in text,
        "aborted_after_diagnosis": any(e[0] == "abort after the diagnosis was stored" for e in events) or not nccl,
        "diagnosis": text,
    }
    print(json.dumps(result))
    ok = result["raised"] and result["named_peer"] and result["named_collective"] and result["aborted_after_diagnosis"]
    sys.stdout.flush()
    # The group is aborted (NCCL) or holds a stand-in wait: leave without tearing it down.
    import os

    os._exit(0 if ok else 1)


class _DoneWork:
    """NCCL's wait: orders the current stream after the collective and returns at once."""

    def wait(self, timeout=None):
        return True


if __name__ == "__main__":
    sys.exit(main())
