"""flops_profiler in one process: the count of a matmul-only model equals the float formula,
and the achieved rate and MFU are that count over the timed step's span (the rate against a
bare matmul is measured by benchmarks/flops_profiler_rate.py, not asserted here)."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from torch import nn

import zeroshard

N = 512


class MatmulOnly(nn.Module):
    """One N x N weight times an N x N input that needs no gradient: the forward is one matmul
    (2 N^3 FLOPs), the backward from a given output gradient one more (the weight's gradient;
    2 N^3). No loss: its elementwise work would be a few percent of the step (and
    `scale_wrt_gas=False`, so that `backward` does not return the output divided by 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(N, N, bias=False)

    def forward(self, x):
        return self.w(x)


def make_engine(micro: int = N, peak: float | None = None, **flops):
    torch.manual_seed(0)
    model = MatmulOnly()
    config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 100, "zeroshard": {"peak_tflops": peak},
              "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
              "flops_profiler": {"enabled": True, "profile_step": 1, **flops}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    return engine


def train(engine, steps: int, rows: int = N) -> None:
    x, grad = torch.randn(rows, N), torch.randn(rows, N)
    for _ in range(steps):
        engine.backward(engine(x), scale_wrt_gas=False, gradient=grad)
        engine.step()


def test_flops_per_step_is_the_matmul_formula_and_recompute_adds_the_forward(caplog):
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        engine = make_engine()
        train(engine, 3)  # step 1 counted, step 2 timed
    figures = engine.figures.summary()
    assert figures["flops/flops_per_step"] == 4 * N**3
    assert figures["flops/forward_flops"] == 2 * N**3
    assert any(r.getMessage().startswith("flops profiler: 0.537 GFLOPs") for r in caplog.records)
    engine = make_engine(recompute_fwd_factor=1.0)
    train(engine, 3)
    assert engine.figures.summary()["flops/flops_per_step"] == 6 * N**3


def test_the_timed_step_is_the_profiled_step_and_the_rate_is_flops_over_its_time():
    """The profiler times step 2 (the one after `profile_step`) and derives its figures from
    that time: the span lies inside the wall time measured around step 2, and achieved TFLOP/s
    and MFU are the count over the span and over the peak. No rate of this machine is asserted
    (a test must not time a shared machine): benchmarks/flops_profiler_rate.py measures the
    achieved rate against the bare matmul rate."""
    batch = 4 * N
    x, grad = torch.randn(batch, N), torch.randn(batch, N)
    engine = make_engine(micro=batch, peak=2.0)
    for _ in range(2):  # step 0, and step 1 (profile_step): counted
        engine.backward(engine(x), scale_wrt_gas=False, gradient=grad)
        engine.step()
    start = time.perf_counter()
    engine.backward(engine(x), scale_wrt_gas=False, gradient=grad)  # step 2: timed
    engine.step()
    outer = time.perf_counter() - start
    figures = engine.figures.summary()
    seconds = figures["flops/step_time_ms"] / 1e3
    assert 0 < seconds <= outer, (seconds, outer)
    assert figures["flops/flops_per_step"] == 4 * batch * N * N
    assert figures["flops/achieved_tflops"] == pytest.approx(4 * batch * N * N / seconds / 1e12, rel=1e-12)
    assert figures["flops/peak_tflops"] == 2.0
    assert figures["flops/mfu"] == pytest.approx(figures["flops/achieved_tflops"] / 2.0, rel=1e-12)


def test_peak_from_the_zeroshard_section():
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": N, "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
              "flops_profiler": {"enabled": True, "profile_step": 0}, "zeroshard": {"peak_tflops": 1000.0}}
    engine, *_ = zeroshard.initialize(model=MatmulOnly(), config=config, dist_init_required=False)
    train(engine, 2)
    figures = engine.figures.summary()
    assert figures["flops/peak_tflops"] == 1000.0
    assert figures["flops/mfu"] == figures["flops/achieved_tflops"] / 1000.0
