"""Optimizers over the engine's master tensors."""

from .build import build_optimizer, repoint_optimizer

__all__ = ["build_optimizer", "repoint_optimizer"]
