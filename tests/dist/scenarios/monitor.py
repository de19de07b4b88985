"""Rank-side scenarios for tests/dist/monitor/: the engine's figures on two ranks."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.scenarios.common import Case, build_engine, case_batches, engine_loop_step


def comms_and_timers(case: Case, interval: int) -> dict[str, Any]:
    """Two intervals of `interval` optimizer steps with comms_logger and wall_clock_breakdown
    on; the second runs inside `zeroshard.comm.recording()` and under the loop's own clock.
    Returns the recorder's bytes and counts per kind, the engine's figures, and the loop's
    mean step time (ms)."""
    engine = build_engine(case)
    batches = case_batches(case)
    for step in range(interval):  # the first interval also holds start-up collectives
        engine_loop_step(engine, case, batches[step])
        engine.step()
    with zeroshard.comm.recording() as log:
        start = time.perf_counter()
        for step in range(interval, 2 * interval):
            engine_loop_step(engine, case, batches[step])
            engine.step()
        loop_ms = (time.perf_counter() - start) * 1e3 / interval
    recorded: dict[str, dict[str, int]] = {}
    for r in log.records:
        row = recorded.setdefault(f"{r.op} (via {r.via})" if r.via else r.op, {"count": 0, "bytes": 0})
        row["count"] += 1
        row["bytes"] += r.bytes
    return {"recorded": recorded, "figures": engine.figures.summary(), "loop_ms": loop_ms}


def moe_exchange(steps: int) -> dict[str, Any]:
    """tests/dist/scenarios/moe_engine.py's two-layer MoE net with ep_size 2 on two ranks,
    figures closed every `steps` optimizer steps (no comms_logger): the MoE figures and
    what the routers chose, counted by the test's own hook."""
    from tests.dist.scenarios.moe_engine import GA, NUM_EXPERTS, EngineCase, build_model, engine_config, micro_batch

    torch.manual_seed(1234 + dist.get_rank())
    model = build_model(2)
    config = {**engine_config(EngineCase(ep_size=2, stage=2)), "steps_per_print": steps}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    chosen = torch.zeros(2, NUM_EXPERTS, dtype=torch.int64)

    def watch(i):
        def hook(module, args, output):
            chosen[i] += output[-1].to(torch.int64)
        return hook

    for i, block in enumerate(model.blocks):
        block.moe.deepspeed_moe.gate.register_forward_hook(watch(i))
    for step in range(steps):
        for micro in range(GA):
            engine.backward(engine(*micro_batch(dist.get_rank(), step, micro)))
            engine.step()
    return {"figures": engine.figures.summary(), "chosen": chosen}
