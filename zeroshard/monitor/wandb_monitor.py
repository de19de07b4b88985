"""``wandb``: a Weights & Biases run; each event is ``log({name: value}, step=samples)``.

The run is started when the engine is built (rank 0), with the section's project, group and
team (entity), and finished at close. ``WANDB_MODE=offline`` keeps it on disk (what the tests use).
"""

from __future__ import annotations

from collections.abc import Iterable

from zeroshard.monitor.events import Event


class WandbMonitor:
    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        try:
            import wandb
        except ImportError as exc:  # the config check catches this first; a clear error regardless
            raise ImportError("wandb monitor: pip install 'zeroshard[wandb]'") from exc
        self._run = wandb.init(project=project, group=group, entity=team)

    def write(self, events: Iterable[Event]) -> None:
        for name, value, samples in events:
            self._run.log({name: value}, step=samples)

    def flush(self) -> None:
        pass  # wandb sends on its own schedule; finish() at close waits for everything

    def close(self) -> None:
        self._run.finish()
