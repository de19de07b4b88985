"""Muon's figure, on whenever Muon steps: the Newton-Schulz time, a part of the step."""

from __future__ import annotations

import torch
from torch import nn

import zeroshard


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.hidden = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.lm_head = nn.Linear(32, 16)

    def forward(self, tokens):
        logits = self.lm_head(self.hidden(self.embed(tokens)))
        return nn.functional.cross_entropy(logits.view(-1, 16), tokens.view(-1))


def train(config: dict, steps: int = 4):
    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=Blocks(), config=config, dist_init_required=False)
    for _ in range(steps):
        engine.backward(engine(torch.randint(0, 16, (4, 8))))
        engine.step()
    return engine.figures.summary()


def test_newton_schulz_time_without_and_with_the_breakdown():
    base = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 4,
            "optimizer": {"type": "Muon", "params": {"lr": 0.02}}}
    figures = train(base)
    assert set(figures) == {"muon/newton_schulz_ms"}, figures
    assert figures["muon/newton_schulz_ms"] > 0
    figures = train({**base, "wall_clock_breakdown": True})
    assert 0 < figures["muon/newton_schulz_ms"] == figures["timers/newton_schulz_ms"] < figures["timers/step_ms"]


def test_no_muon_figure_with_adamw():
    figures = train({"train_micro_batch_size_per_gpu": 4, "steps_per_print": 4,
                     "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}})
    assert figures == {}
