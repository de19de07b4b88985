"""`engine.monitor`: DeepSpeed's MonitorMaster. Rank 0 builds the enabled monitors and writes;
every other rank has the same object, enabled alike, and writes nothing (DeepSpeed's behaviour).

`write_events([(name, value, samples), ...])` takes the user's own scalars too. Writes go
through one background thread (background.py); `close()` (engine.destroy(), or at interpreter
exit) flushes and closes the files.

A monitor that cannot start (an `output_path` whose folder cannot be created, a `wandb.init`
that fails) is refused at `initialize` on every rank: rank 0's outcome is shared in one small
all-gather (only when a monitor is on), so no rank trains on while rank 0 has raised. A
monitor that fails after it started (a full disk) is switched off with one logged error and
training goes on (background.py).
"""

from __future__ import annotations

import atexit
import os
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zeroshard.comm import collectives as comm
from zeroshard.config.error import ConfigError
from zeroshard.monitor.background import BackgroundWriter, Sink
from zeroshard.monitor.events import Event

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig


def _folder_problem(section: str, output_path: str, job_name: str, error: OSError) -> str:
    folder = os.path.join(output_path, job_name)
    return (
        f"{section}.output_path={output_path!r}: cannot create the monitor folder {folder!r} on rank 0 "
        f"({type(error).__name__}: {error}). Give an output_path whose folders this process can create, "
        f"or set {section}.enabled to false."
    )


def build_sinks(config: ZeroshardConfig) -> list[Sink]:
    """The enabled monitors, opened (rank 0). ConfigError naming the section when one cannot
    start; the ones opened before it are closed again."""
    sinks: list[Sink] = []
    try:
        if config.csv_monitor.enabled:
            from zeroshard.monitor.csv_monitor import CsvMonitor

            csv = config.csv_monitor
            try:
                sinks.append(CsvMonitor(csv.output_path, csv.job_name))
            except OSError as error:
                raise ConfigError(_folder_problem("csv_monitor", csv.output_path, csv.job_name, error)) from error
        if config.tensorboard.enabled:
            from zeroshard.monitor.tensorboard_monitor import TensorBoardMonitor

            tb = config.tensorboard
            try:
                sinks.append(TensorBoardMonitor(tb.output_path, tb.job_name))
            except OSError as error:
                raise ConfigError(_folder_problem("tensorboard", tb.output_path, tb.job_name, error)) from error
        if config.wandb.enabled:
            from zeroshard.monitor.wandb_monitor import WandbMonitor

            try:
                sinks.append(WandbMonitor(config.wandb.project, config.wandb.group, config.wandb.team))
            except Exception as error:  # wandb raises its own types (no login, no network, ...)
                raise ConfigError(
                    f"wandb.project={config.wandb.project!r}: wandb.init failed on rank 0 ({type(error).__name__}: "
                    f"{error}). Fix the wandb setup (WANDB_MODE=offline writes to disk), or set wandb.enabled "
                    "to false."
                ) from error
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


class MonitorMaster:
    """The enabled monitors of a config, written from rank 0 only.

    Attributes:
        enabled: any monitor is on in the config (the same on every rank, as DeepSpeed's).
    """

    def __init__(self, config: ZeroshardConfig, rank: int, world: comm.Group | None = None) -> None:
        self.enabled = config.csv_monitor.enabled or config.tensorboard.enabled or config.wandb.enabled
        self.rank = rank
        self._writer: BackgroundWriter | None = None
        sinks, problem = None, None
        if self.enabled and rank == 0:
            try:
                sinks = build_sinks(config)
            except ConfigError as error:
                problem = str(error)
        if self.enabled and world is not None and world.size > 1:
            # Every rank learns rank 0's outcome: all raise, or none does (`enabled` is the same
            # everywhere, so every rank takes part). `world` is the engine's whole world.
            problem = comm.all_gather_object(problem, group=world)[0]
        if problem is not None:
            raise ConfigError(problem)
        if sinks is not None:
            self._writer = BackgroundWriter(sinks)
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
