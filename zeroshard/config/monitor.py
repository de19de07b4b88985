"""The monitor sections of a config: ``tensorboard``, ``wandb``, ``csv_monitor`` (DeepSpeed 0.19's
keys and defaults), and why ``comet`` is refused.

The writers themselves are in zeroshard/monitor/. A monitor whose package is missing is a config
error naming the extra to install, so a run never starts believing it is being recorded. This
module imports nothing outside zeroshard/config (tests/unit/config/test_config_leaf.py): the
packages are looked up with ``importlib.util.find_spec``, not imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

from zeroshard.config.base import _Report, _Section

# DeepSpeed's default job name: the folder under output_path the files go into.
DEFAULT_JOB_NAME = "DeepSpeedJobName"

COMET_REFUSAL = (
    "Comet needs the comet_ml package and a Comet account, so zeroshard cannot test it. Use "
    "csv_monitor, tensorboard or wandb (docs/monitoring.md), or log engine.metrics() yourself"
)


def _require_package(raw: dict[str, Any], path: str, report: _Report, module: str, extra: str) -> None:
    if raw.get("enabled") is True and importlib.util.find_spec(module) is None:
        report.problems.append(
            f"{path}.enabled=true: the '{module}' package is not installed. "
            f"Install it with: pip install 'zeroshard[{extra}]'."
        )


class TensorBoardConfig(_Section):
    """``tensorboard``: event files under ``output_path/job_name`` (rank 0 writes).

    An empty ``output_path`` (the default) means the current directory, as in DeepSpeed.
    """

    enabled: bool = False
    output_path: str = ""
    job_name: str = DEFAULT_JOB_NAME

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        _require_package(raw, path, report, "tensorboard", "tensorboard")


class CsvMonitorConfig(_Section):
    """``csv_monitor``: one CSV file per event under ``output_path/job_name`` (rank 0 writes)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = DEFAULT_JOB_NAME


class WandbConfig(_Section):
    """``wandb``: a Weights & Biases run (rank 0 logs). ``team`` is the wandb entity."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        _require_package(raw, path, report, "wandb", "wandb")


def monitor_destinations(config: Any) -> list[str]:
    """Where each enabled monitor writes, one line each (what `zeroshard explain` prints)."""
    lines = []
    if config.csv_monitor.enabled:
        section = config.csv_monitor
        lines.append(f"csv_monitor: {os.path.join(section.output_path, section.job_name)}/*.csv (rank 0)")
    if config.tensorboard.enabled:
        section = config.tensorboard
        folder = os.path.join(section.output_path, section.job_name)
        lines.append(f"tensorboard: {folder}/events.out.tfevents.* (rank 0)")
    if config.wandb.enabled:
        section = config.wandb
        where = "/".join(x for x in (section.team, section.project) if x)
        group = f", group {section.group}" if section.group else ""
        lines.append(f"wandb: project {where}{group} (rank 0)")
    return lines
