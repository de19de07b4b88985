"""What an engine builds to be seen: its figures (timers, FLOPs, collectives, MoE and Muon),
DeepSpeed's monitors (csv, tensorboard, wandb) and `engine.metrics()`, joined in one place so the
engine holds three attributes and imports one module for them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.monitor.figures import RunFigures
from zeroshard.monitor.master import MonitorMaster
from zeroshard.monitor.training_figures import TrainingFigures


def build_monitoring(
    module: nn.Module, config: Any, device: torch.device, rank: int, optimizer: Any, fp16: bool
) -> tuple[RunFigures, MonitorMaster, TrainingFigures]:
    """(figures, monitor, training figures); `metrics()` of the last includes the figures'
    summary under their own keys (`timers/...`, `flops/...`, `comms/...`, `moe/...`)."""
    figures = RunFigures(module, config, device, rank, optimizer)
    monitor = MonitorMaster(config, rank)
    training = TrainingFigures(monitor, fp16=fp16)
    training.register("", figures.summary)
    return figures, monitor, training
