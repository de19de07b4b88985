"""The stop request a scheduler's signal leaves behind: handlers that only set a flag.

A signal handler in Python runs in the main thread between two bytecodes, wherever the program
happens to be (inside a write, a collective's wait, a logging call holding its lock). So the
handler here does nothing but store the signal's number and count it: no I/O, no logging, no
lock, no collective. Everything else (agreeing, saving, exiting) happens later at a step
boundary, from ordinary code (zeroshard/checkpoint/preempt.py).

The flag is one per process, as signal dispositions are.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from typing import Any


class StopRequest:
    """Whether this process was asked to stop, and by which signal (the first one)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Async-signal-safe in Python's sense: two attribute stores, nothing that can block.
        if self.signum is None:
            self.signum = signum
        self.count += 1

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for the stop from code (a callback of your scheduler's client, a test)."""
        self._on_signal(signum, None)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return "none" if self.signum is None else signal.Signals(self.signum).name

    def install(self, signums: Iterable[int]) -> list[int]:
        """Handle `signums` here; returns those installed (none outside the main thread, where
        Python cannot install a handler: a caller there says so)."""
        if threading.current_thread() is not threading.main_thread():
            return []
        installed = []
        for signum in signums:
            previous = signal.signal(signum, self._on_signal)
            self._previous.setdefault(signum, previous)
            installed.append(signum)
        return installed

    def uninstall(self) -> None:
        """Give every signal its handler from before `install` back."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def ignore(self, signums: Iterable[int]) -> None:
        """Ignore `signums` from now on (main thread only; `uninstall` restores the handlers
        from before `install`).

        For a process that has decided to exit: CPython's shutdown resets every Python-level
        handler to the default action (terminate), but keeps SIG_IGN. A launcher that sends
        SIGTERM to the remaining workers once the first one exited (torchrun's agent does) would
        otherwise kill a worker still in shutdown, which then reports -15 instead of its status.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in signums:
            previous = signal.signal(signum, signal.SIG_IGN)
            self._previous.setdefault(signum, previous)

    def clear(self) -> None:
        self.signum = None
        self.count = 0


STOP = StopRequest()
