"""`comms_logger`: per collective kind, how many ran, how many bytes, how long, how fast.

The collective recorder (zeroshard/comm/collectives.py) sees every collective the engine
issues; `CommsLogger` is a recording that stays open for the engine's life and is also told
each collective's duration: from its issue to its completion (a blocking call's return, or
the `wait()` of an asynchronous one), so an overlapped collective's time includes the compute
it overlapped. On CUDA the two ends are events on the issuing stream, read at the summary.

Bandwidth is the algorithm bandwidth: the recorder's bytes (the full, unsharded buffer) over
that time. A reduce-scatter that gloo runs as an all-reduce is listed as
"reduce_scatter (via all_reduce)". DeepSpeed's keys: `enabled`; `prof_all` (default true) and
`prof_ops` (the op names to keep when prof_all is false); `verbose` and `debug` are accepted
and change nothing (every collective is summarised, none is printed alone).
"""

from __future__ import annotations

from typing import Any

from zeroshard.comm.collectives import CollectiveLog, CollectiveRecord

__all__ = ["CommsLogger"]


def _kind(record: CollectiveRecord) -> str:
    return f"{record.op} (via {record.via})" if record.via else record.op


class CommsLogger(CollectiveLog):
    """Collectives summarised per kind over an interval (see the module note)."""

    timed = True

    def __init__(self, section: dict[str, Any] | None) -> None:
        super().__init__()
        section = section or {}
        self.enabled = bool(section.get("enabled", False))
        prof_all = bool(section.get("prof_all", True))
        self.ops = None if prof_all else set(section.get("prof_ops", []))
        self._durations: list[tuple[CollectiveRecord, object, object]] = []
        self._last: dict[str, dict[str, float]] = {}

    def add_duration(self, record: CollectiveRecord, start: object, end: object) -> None:
        self._durations.append((record, start, end))

    @staticmethod
    def _seconds(start: object, end: object) -> float:
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def close_interval(self) -> dict[str, dict[str, float]]:
        """Per kind: count, bytes, time_ms, bandwidth_GBps of the collectives since the last
        call (those not yet completed count at the next); starts the next interval."""
        table: dict[str, dict[str, float]] = {}
        for record in self.records:
            if self.ops is not None and record.op not in self.ops:
                continue
            row = table.setdefault(_kind(record), {"count": 0, "bytes": 0, "time_ms": 0.0})
            row["count"] += 1
            row["bytes"] += record.bytes
        for record, start, end in self._durations:
            if self.ops is None or record.op in self.ops:
                row = table.setdefault(_kind(record), {"count": 0, "bytes": 0, "time_ms": 0.0})
                row["time_ms"] += self._seconds(start, end) * 1e3
        for row in table.values():
            seconds = row["time_ms"] / 1e3
            row["bandwidth_GBps"] = row["bytes"] / seconds / 1e9 if seconds > 0 else 0.0
        self.records = []
        self._durations = []
        self._last = table
        return table

    def time_ms(self, kind: str) -> float:
        """The last interval's time of one kind (0 when none ran)."""
        return self._last.get(kind, {}).get("time_ms", 0.0)

    def summary(self) -> dict[str, float]:
        """The last interval as `comms/<kind>/<figure>`."""
        return {f"comms/{kind}/{name}": float(v) for kind, row in self._last.items() for name, v in row.items()}

    def log_lines(self) -> list[str]:
        lines = [f"{'collective':<32}{'count':>8}{'bytes':>14}{'time (ms)':>12}{'GB/s':>10}"]
        for kind, row in sorted(self._last.items()):
            lines.append(
                f"{kind:<32}{row['count']:>8}{row['bytes']:>14}{row['time_ms']:>12.2f}{row['bandwidth_GBps']:>10.3f}"
            )
        return lines
