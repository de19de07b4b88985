"""wall_clock_breakdown in one process: the parts add up to the step the loop timed, and the
log line has DeepSpeed's timer names."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

import zeroshard


class Wide(nn.Module):
    """Two 256-wide layers: a step of a few milliseconds, so the Python between the engine's
    calls is a small share of it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def make_engine(stage: int, **config):
    torch.manual_seed(0)
    model = Wide()
    base = {"train_micro_batch_size_per_gpu": 64, "gradient_accumulation_steps": 2, "steps_per_print": 4,
            "wall_clock_breakdown": True, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = zeroshard.initialize(model=model, config={**base, **config}, dist_init_required=False)
    return engine


def run_steps(engine, steps: int) -> float:
    """Mean wall time of one optimizer step (forward, backward, step of each micro-batch) as
    the loop sees it."""
    batches = [torch.randn(64, 256) for _ in range(2 * steps)]
    start = time.perf_counter()
    for x in batches:
        engine.backward(engine(x))
        engine.step()
    return (time.perf_counter() - start) * 1e3 / steps


def test_breakdown_parts_sum_to_the_step_time(caplog):
    for stage in (1, 3):
        engine = make_engine(stage)
        run_steps(engine, 4)  # warm-up interval (closed at step 4)
        with caplog.at_level(logging.INFO, logger="zeroshard"):
            loop_ms = run_steps(engine, 4)
        figures = engine.figures.summary()
        parts = figures["timers/fwd_ms"] + figures["timers/bwd_ms"] + figures["timers/step_ms"]
        # The loop's time is the parts plus the Python between the calls (list iteration, the
        # calls themselves): tens of microseconds per call against milliseconds of work. 10%
        # leaves room for a machine shared with other jobs; the parts can never exceed it.
        assert parts <= loop_ms * 1.001, (stage, parts, loop_ms)
        assert parts >= 0.90 * loop_ms, (stage, parts, loop_ms)
        assert figures["timers/steps"] == 4
        inner = figures["timers/bwd_inner_ms"]
        assert 0 < inner <= figures["timers/bwd_ms"]
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("time (ms)")]
        assert len(lines) == 1, lines
        for name in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"):
            assert f"| {name}: " in lines[0]
        caplog.clear()


def test_breakdown_off_records_nothing_and_summary_is_empty():
    engine = make_engine(2, wall_clock_breakdown=False)
    run_steps(engine, 4)
    assert engine.figures.summary() == {}
    assert not engine.timers.enabled


def test_monitor_events_use_deepspeed_names():
    engine = make_engine(2)
    run_steps(engine, 4)
    names = [name for name, _, _ in engine.figures.monitor_events(samples=512)]
    assert names == [
        "Train/Samples/elapsed_time_ms_forward", "Train/Samples/elapsed_time_ms_backward",
        "Train/Samples/elapsed_time_ms_backward_inner", "Train/Samples/elapsed_time_ms_backward_allreduce",
        "Train/Samples/elapsed_time_ms_step",
    ]
