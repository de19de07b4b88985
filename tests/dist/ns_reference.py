"""Newton-Schulz written from the formula, for float64 references (the Muon tests)."""

from __future__ import annotations

import torch


def reference_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic of [Note: Newton-Schulz] (zeroshard/optim/muon/newton_schulz.py) on one matrix,
    normalised by its own Frobenius norm, wide orientation (a tall matrix is transposed)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = g.shape[0] > g.shape[1]
    x = g.T if tall else g
    x = x / (torch.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x
