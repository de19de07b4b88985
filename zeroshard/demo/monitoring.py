"""The demo's monitoring: csv_monitor files in its run directory, wall_clock_breakdown's timers,
and at the end the `zeroshard report` PNGs drawn from those files (docs/monitoring.md).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

from zeroshard.tools.report import ReportError, write_report

# The csv_monitor's job_name: the files go to RUN_DIR/csv/*.csv.
CSV_JOB_NAME = "csv"

# The loss the demo prints and keeps in metrics.jsonl (the mean over ranks), as a monitor event
# beside the engine's own `Train/Samples/train_loss` (rank 0's loss only, DeepSpeed's event).
# Its name does not end in "train_loss", so `zeroshard report` still plots DeepSpeed's event.
LOGGED_LOSS_EVENT = "Train/Samples/train_loss_mean_over_ranks"


def with_monitoring(config: dict, run_dir: Path) -> dict:
    """`config` with csv_monitor writing into `run_dir` and wall_clock_breakdown on.

    A config that sets either key itself keeps its own setting: a user's --config decides.
    """
    config = copy.deepcopy(config)
    config.setdefault(
        "csv_monitor", {"enabled": True, "output_path": str(run_dir), "job_name": CSV_JOB_NAME}
    )
    config.setdefault("wall_clock_breakdown", True)
    return config


def csv_folder(resolved) -> Path | None:
    """Where the resolved config's csv_monitor writes (None when it is off)."""
    section = resolved.csv_monitor
    if not section.enabled:
        return None
    return Path(os.path.join(section.output_path, section.job_name))


def write_report_pngs(csv_dir: Path | None, out_dir: Path) -> tuple[list[Path], str | None]:
    """Draw `zeroshard report`'s PNGs from `csv_dir` into `out_dir`.

    Returns:
        The PNGs written, and why none were when that is so (the run still succeeds: the
        report is a by-product, not the training's result).
    """
    if csv_dir is None:
        return [], "csv_monitor is off in the config"
    try:
        return write_report(csv_dir, out_dir), None
    except ReportError as error:
        return [], str(error)
