"""What an engine builds to be seen, around DeepSpeed's monitors (csv, tensorboard, wandb:
master.py, built first): its figures (timers, FLOPs, collectives, MoE and Muon) and
`engine.metrics()`, joined in one place."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.monitor.figures import RunFigures
from zeroshard.monitor.master import MonitorMaster
from zeroshard.monitor.training_figures import TrainingFigures


def build_monitoring(
    module: nn.Module, config: Any, device: torch.device, rank: int, optimizer: Any, monitor: MonitorMaster,
    fp16: bool,
) -> tuple[RunFigures, TrainingFigures]:
    """(figures, training figures) around the engine's `monitor` (built first, at the start of
    the engine: it may refuse the config); `metrics()` of the training figures includes the
    figures' summary under their own keys (`timers/...`, `flops/...`, `comms/...`, `moe/...`)."""
    figures = RunFigures(module, config, device, rank, optimizer)
    training = TrainingFigures(monitor, fp16=fp16)
    training.register("", figures.summary)
    return figures, training
