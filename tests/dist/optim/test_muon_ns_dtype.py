"""Muon with a half-precision Newton-Schulz dtype on small gradients, sharded over 2 ranks.

At stages 1-3 each rank holds part of a matrix's momentum direction u and all-gathers it
before Newton-Schulz. u is not normalised yet, so an fp16 wire flushes entries of 1e-6 into
fp16's subnormals (see [Note: normalise before casting] in zeroshard/optim/muon/newton_schulz.py).
The model's loss is sum(W * G) for a fixed G, so the gradient is G exactly and the first
Muon step moves W by -lr * NS(u) with u = (1 - beta) (1 + beta) G (Nesterov momentum from a
zero buffer); the reference is NS(u) in float64 (u, not G: the 1e-7 added to the norm is not
negligible against ||u|| = 6e-6 at RMS 1e-6).

Tolerance: the relative Frobenius error of the update, with the bounds the unit tests give a
unit-scale input in that dtype (fp16 1e-2, bf16 8e-2); the scale of G must not matter. Seen:
fp16 4.3e-3 (RMS 1e-6) and 3.7e-3 (1e-4), bf16 4.3e-2 and 4.0e-2, at every stage. The old
code (cast to fp16 before normalising, fp16 wire) gave 0.58 at RMS 1e-6 and 0.011 at 1e-4
for fp16 on every stage; with only Newton-Schulz fixed, the fp16 wire alone still gave 0.58
at stages 1 and 3. Stage 0 gathers no u: it checks Newton-Schulz alone.
"""

from __future__ import annotations

import torch
from torch import nn

import zeroshard
from zeroshard.optim.muon.newton_schulz import orthogonalize
from zeroshard.optim.muon.optimizer import ShardedMuon, split_param_groups

ROWS, COLS = 16, 64  # 1024 elements: each rank's shard is half of the one matrix
LR = 1.0
MOMENTUM = 0.9
BOUNDS = {"fp16": 1e-2, "bf16": 8e-2}
CASES = [(stage, dtype, rms) for stage in (0, 1, 3) for dtype in ("fp16", "bf16") for rms in (1e-6, 1e-4)]


def target_gradient(rms: float) -> torch.Tensor:
    """A float64 matrix with singular values log-spaced over [1e-2, 1], scaled to element RMS `rms`."""
    gen = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(ROWS, ROWS, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(COLS, ROWS, generator=gen, dtype=torch.float64))
    g = u @ torch.diag(torch.logspace(0, -2, ROWS, dtype=torch.float64)) @ v.T
    return g * (rms / g.pow(2).mean().sqrt())


class Linear(nn.Module):
    def __init__(self, gradient: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(ROWS, COLS))
        self.register_buffer("gradient", gradient)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.gradient).sum() + 0.0 * x.sum()


def first_update(cases: list[tuple[int, str, float]]) -> list[torch.Tensor]:
    """Per case (stage, ns_dtype, rms): W after one step minus W before, full size (float64)."""
    updates = []
    for stage, ns_dtype, rms in cases:
        torch.manual_seed(0)
        model = Linear(target_gradient(rms).float())
        before = model.weight.detach().double().clone()
        params_cfg = {"lr": LR, "momentum": MOMENTUM, "weight_decay": 0.0, "ns_dtype": ns_dtype}
        hyper, group_of = split_param_groups(model, [{}], {id(model.weight): 0}, params_cfg)
        groups = [dict(h, params=[p for p in model.parameters() if group_of[id(p)] == i]) for i, h in enumerate(hyper)]
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "steps_per_print": 1000,
        }
        engine, optimizer, _, _ = zeroshard.initialize(
            model=model, model_parameters=groups, optimizer=lambda g: ShardedMuon(g), config=config
        )
        optimizer.attach_flats(engine.flats)
        engine.backward(engine(torch.ones(1)))
        engine.step()
        after = zeroshard.safe_get_full_fp32_param(model.weight)
        updates.append(after.double() - before)
    return updates


def test_half_precision_ns_keeps_small_sharded_updates(dist_pool):
    per_rank = dist_pool(2).run(first_update, CASES, timeout=120)
    for (stage, ns_dtype, rms), update in zip(CASES, per_rank[0], strict=True):
        u = (1 - MOMENTUM) * (1 + MOMENTUM) * target_gradient(rms).float().double()
        expected = -LR * orthogonalize(u, method="standard")
        error = float((update - expected).norm() / expected.norm())
        assert error < BOUNDS[ns_dtype], f"stage {stage} ns_dtype {ns_dtype} rms {rms:g}: relative error {error:.3g}"
    for rank_updates in per_rank[1:]:
        for ours, theirs in zip(per_rank[0], rank_updates, strict=True):
            assert torch.equal(ours, theirs), "ranks disagree on the update"
