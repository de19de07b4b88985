"""Monitoring: DeepSpeed's csv_monitor, tensorboard and wandb writers (rank 0, a background
thread) and the figures behind `engine.metrics()`. See docs/monitoring.md."""

from zeroshard.monitor.events import LOSS_SCALE, LR, TRAIN_LOSS
from zeroshard.monitor.figures import StepFigures
from zeroshard.monitor.master import MonitorMaster

__all__ = ["LOSS_SCALE", "LR", "MonitorMaster", "StepFigures", "TRAIN_LOSS"]
