"""``csv_monitor``: one CSV file per event name, DeepSpeed's layout.

``output_path/job_name/<name with "/" and " " as "_">.csv``, e.g.
``Train_Samples_train_loss.csv``; the first row is ``step,<last part of the name>`` (DeepSpeed
calls the samples column "step"), then one ``samples,value`` row per event. A file that exists
from an earlier run is appended to, its header written again, as DeepSpeed does.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Iterable
from typing import IO

from zeroshard.monitor.events import Event


def csv_file_name(event_name: str) -> str:
    return event_name.replace("/", "_").replace(" ", "_") + ".csv"


class CsvMonitor:
    """Appends events to their CSV files; keeps each file open (one open per name per run)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._files: dict[str, tuple[IO[str], csv.writer]] = {}

    def _writer(self, name: str):
        entry = self._files.get(name)
        if entry is None:
            handle = open(os.path.join(self.log_dir, csv_file_name(name)), "a", newline="")  # noqa: SIM115
            writer = csv.writer(handle)
            writer.writerow(["step", name.split("/")[-1]])
            entry = self._files[name] = (handle, writer)
        return entry[1]

    def write(self, events: Iterable[Event]) -> None:
        for name, value, samples in events:
            self._writer(name).writerow([samples, value])

    def flush(self) -> None:
        for handle, _ in self._files.values():
            handle.flush()

    def close(self) -> None:
        for handle, _ in self._files.values():
            handle.close()
        self._files.clear()
