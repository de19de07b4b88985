"""`engine.monitor`: DeepSpeed's MonitorMaster. Rank 0 builds the enabled monitors and writes;
every other rank has the same object, enabled alike, and writes nothing (DeepSpeed's behaviour).

`write_events([(name, value, samples), ...])` takes the user's own scalars too. Writes go
through one background thread (background.py); `close()` (engine.destroy(), or at interpreter
exit) flushes and closes the files.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zeroshard.monitor.background import BackgroundWriter, Sink
from zeroshard.monitor.events import Event

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig


def build_sinks(config: ZeroshardConfig) -> list[Sink]:
    sinks: list[Sink] = []
    if config.csv_monitor.enabled:
        from zeroshard.monitor.csv_monitor import CsvMonitor

        sinks.append(CsvMonitor(config.csv_monitor.output_path, config.csv_monitor.job_name))
    if config.tensorboard.enabled:
        from zeroshard.monitor.tensorboard_monitor import TensorBoardMonitor

        sinks.append(TensorBoardMonitor(config.tensorboard.output_path, config.tensorboard.job_name))
    if config.wandb.enabled:
        from zeroshard.monitor.wandb_monitor import WandbMonitor

        sinks.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
    return sinks


class MonitorMaster:
    """The enabled monitors of a config, written from rank 0 only.

    Attributes:
        enabled: any monitor is on in the config (the same on every rank, as DeepSpeed's).
    """

    def __init__(self, config: ZeroshardConfig, rank: int) -> None:
        self.enabled = config.csv_monitor.enabled or config.tensorboard.enabled or config.wandb.enabled
        self.rank = rank
        self._writer: BackgroundWriter | None = None
        if self.enabled and rank == 0:
            self._writer = BackgroundWriter(build_sinks(config))
            # A weak reference: the exit hook must not keep a dropped engine alive. One function
            # per master, so unregistering it leaves other engines' hooks in place.
            ref = weakref.ref(self)

            def close_at_exit() -> None:
                master = ref()
                if master is not None:
                    master.close()

            self._exit_hook = close_at_exit
            atexit.register(close_at_exit)

    @property
    def writes(self) -> bool:
        """Whether this rank writes (rank 0 with a monitor on)."""
        return self._writer is not None

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Queue `(name, value, samples)` events for every monitor (rank 0; elsewhere a no-op).
        Values may be numbers or 0-d tensors; nothing here waits for the disk or the device."""
        if self._writer is not None:
            self._writer.put(event_list)

    def flush(self) -> None:
        """Wait until everything written so far is on disk (or handed to wandb)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            atexit.unregister(self._exit_hook)
            self._writer = None

    def __del__(self) -> None:
        if getattr(self, "_writer", None) is not None:
            self._writer.close(timeout=5.0)
