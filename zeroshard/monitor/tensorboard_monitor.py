"""``tensorboard``: scalar events in a TensorBoard event file under ``output_path/job_name``.

Written with ``torch.utils.tensorboard.SummaryWriter`` (which needs the ``tensorboard``
package), one ``add_scalar(name, value, samples)`` per event, as DeepSpeed does.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from zeroshard.monitor.events import Event


class TensorBoardMonitor:
    def __init__(self, output_path: str, job_name: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # the config check catches this first; a clear error regardless
            raise ImportError("tensorboard monitor: pip install 'zeroshard[tensorboard]'") from exc
        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, events: Iterable[Event]) -> None:
        for name, value, samples in events:
            self._writer.add_scalar(name, value, samples)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
