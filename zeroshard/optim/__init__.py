"""Optimizers over the engine's master tensors."""

from .build import build_optimizer, repoint_optimizer
from .muon import Muon, ShardedMuon

__all__ = ["build_optimizer", "repoint_optimizer", "Muon", "ShardedMuon"]
