"""Optimizers over the engine's master tensors."""

from zeroshard.optim.build import build_optimizer, repoint_optimizer
from zeroshard.optim.muon.optimizer import Muon, ShardedMuon

__all__ = ["build_optimizer", "repoint_optimizer", "Muon", "ShardedMuon"]
