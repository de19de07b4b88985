"""Rows of the GPU check: each check runs in its own try/except under a time limit, and the JSON
is rewritten after every row (a run killed half-way keeps what it finished)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


class CheckTimeout(Exception):
    """A check ran past its time budget."""


class Skip(Exception):
    """A check that does not apply here (raise it with the reason)."""


@dataclass
class Row:
    name: str
    status: str  # "ok", "FAIL" or "skip"
    seconds: float
    numbers: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise CheckTimeout in the main thread after `seconds` (SIGALRM: it interrupts Python code
    between bytecodes, so a check stuck inside one long native call is stopped after it)."""

    def expire(signum, frame):
        raise CheckTimeout(f"past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Report:
    """The rows so far, mirrored to `outdir/gpu_check.json` after each one."""

    def __init__(self, outdir: Path, meta: dict[str, Any]) -> None:
        self.outdir = outdir
        self.meta = meta
        self.rows: list[Row] = []
        outdir.mkdir(parents=True, exist_ok=True)
        self._write()

    def run(self, name: str, check: Callable[[], dict[str, Any] | tuple[str, dict[str, Any], str]],
            budget_s: float) -> Row:
        """Run `check` as row `name`. It returns its numbers (status ok), or (status, numbers,
        detail); an AssertionError is a FAIL with its message, Skip a skip, anything else a FAIL
        with the traceback's tail."""
        start = time.perf_counter()
        status, numbers, detail = "ok", {}, ""
        try:
            with time_limit(budget_s):
                out = check()
            if isinstance(out, tuple):
                status, numbers, detail = out
            else:
                numbers = out or {}
        except Skip as why:
            status, detail = "skip", str(why)
        except AssertionError as error:
            status, detail = "FAIL", str(error)[-2000:]
        except BaseException as error:  # noqa: BLE001 - one broken check must not stop the others
            if isinstance(error, KeyboardInterrupt):
                raise
            status = "FAIL"
            detail = f"{type(error).__name__}: {error}"[:1000] + "\n" + traceback.format_exc()[-3000:]
        row = Row(name, status, round(time.perf_counter() - start, 2), numbers, detail)
        self.rows.append(row)
        self._write()
        mark = {"ok": "ok  ", "FAIL": "FAIL", "skip": "skip"}[status]
        print(f"[gpu_check] {mark} {name} ({row.seconds:.1f} s) {_short(numbers)}", flush=True)
        if status == "FAIL":
            print("    " + detail.strip().replace("\n", "\n    ")[-1500:], flush=True)
        return row

    def _write(self) -> None:
        path = self.outdir / "gpu_check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "rows": [asdict(r) for r in self.rows]}, indent=1,
                                  default=str))
        os.replace(tmp, path)

    def table(self) -> str:
        lines = [f"{'check':<34} {'status':<6} {'s':>7}  numbers"]
        for r in self.rows:
            lines.append(f"{r.name:<34} {r.status:<6} {r.seconds:>7.1f}  {_short(r.numbers)}")
        counts = {s: sum(r.status == s for r in self.rows) for s in ("ok", "FAIL", "skip")}
        lines.append(f"{counts['ok']} ok, {counts['FAIL']} FAIL, {counts['skip']} skip")
        return "\n".join(lines)


def _short(numbers: dict[str, Any], limit: int = 160) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        if isinstance(v, (list, dict)):
            return f"[{len(v)}]"
        return str(v)

    text = " ".join(f"{k}={fmt(v)}" for k, v in numbers.items())
    return text if len(text) <= limit else text[: limit - 3] + "..."
