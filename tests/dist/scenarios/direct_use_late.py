"""Rank-side scenario for tests/dist/sharding/test_stage3_direct_use_late.py: a direct use that
first appears at a later step, and the parameter classes the direct-use watch gives
(zeroshard/sharding/direct_use.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.dist.reference import Block, TinyModel
from tests.dist.scenarios.common import Case, build_engine, case_batches, detached, full_grads, my_micro_batch

UNITS = {"zeroshard": {"unit_module_classes": ["Block", "ProbeBlock", "Embedding"]}}


class ProbeBlock(Block):
    """A Block that records, in `seen`, the class of its own weight and of its peer's (a block
    it holds in a plain list, so not a submodule) while its forward runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen["own, in its forward"] = type(self.fc.weight).__name__
        self.seen["peer's, in its forward"] = type(self.peers[0].fc.weight).__name__
        return super().forward(x)


class LateUseModel(TinyModel):
    """TinyModel; from its `late_from`-th training forward on (counting from 1), the root also
    adds `0.1 * h @ blocks[2].fc.weight.T` after the blocks ran: a direct use of block 2's unit
    that no earlier forward made. Records the parameter classes the root and block 1 see."""

    def __init__(self, late_from: int) -> None:
        super().__init__()
        self.late_from = late_from
        self.training_forwards = 0
        self.seen: dict[str, str] = {}
        probe = self.blocks[1]
        probe.__class__ = ProbeBlock  # draws nothing: the seed gives TinyModel's weights
        probe.seen, probe.peers = self.seen, [self.blocks[2]]

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        self.training_forwards += self.training
        self.seen["blocks.1's, in the root"] = type(self.blocks[1].fc.weight).__name__
        h = super().hidden(tokens)
        if self.training and self.training_forwards >= self.late_from:
            h = h + 0.1 * (h @ self.blocks[2].fc.weight.T)
        return h


def late_direct_use(stage: int, steps: int, late_from: int) -> dict[str, Any]:
    """Train LateUseModel `steps` steps at `stage` (fp32, one micro-step per step): per step
    the loss and the full reduced gradients (read between backward and step), the classes
    seen in the last forward, and the classes of every parameter after training."""
    case = Case(stage=stage, steps=steps, extra=UNITS)
    torch.manual_seed(case.seed)
    model = LateUseModel(late_from)
    engine = build_engine(case, model)
    out: dict[str, Any] = {"losses": [], "grads": []}
    for batch in case_batches(case):
        tokens, targets = my_micro_batch(batch, 0, case)
        loss = engine(tokens, targets)
        engine.backward(loss)
        out["losses"].append(detached(loss))
        out["grads"].append(full_grads(engine))
        engine.step()
    out["seen"] = dict(model.seen)
    out["classes_after"] = {type(p).__name__ for p in model.parameters()}
    out["plain_after"] = all(type(p) is nn.Parameter for p in model.parameters())
    engine.destroy()
    return out
