"""Rank-side scenarios for tests/dist/sharding/test_stage3_caps.py: DeepSpeed's stage-3 memory
caps (`stage3_max_live_parameters`, `stage3_max_reuse_distance`) on the TinyModel."""

from __future__ import annotations

from typing import Any

from tests.dist.scenarios.common import Case, build_engine, detached, my_micro_batch, train
from zeroshard.comm import collectives as comm


def _param_gathers(log) -> int:
    return sum(1 for r in log.records if r.op == "all_gather" and r.tag == "param")


def run_caps(settings: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """For each (label, zero_optimization keys): 3 stage-3 steps; the `train` result plus the
    schedule's peak of elements held gathered, the units' sizes, and the parameter all-gathers
    that each step's forwards and backwards issued."""
    results = []
    for label, zero in settings:
        case = Case(stage=3, variant=label, extra={"zero_optimization": zero})
        engine = build_engine(case)
        schedule = engine._grads.params
        schedule.track_peak = True
        phases = {"forward": [], "backward": []}

        def step(engine, case, batch, *, phases=phases):
            losses = []
            for j in range(case.ga):
                tokens, targets = my_micro_batch(batch, j, case)
                with comm.recording() as log:
                    loss = engine(tokens, targets)
                phases["forward"].append(_param_gathers(log))
                with comm.recording() as log:
                    engine.backward(loss)
                phases["backward"].append(_param_gathers(log))
                losses.append(detached(loss))
            return losses

        out = train(engine, case, step_fn=step)
        out.update(
            label=case.label, peak=schedule.peak_held_numel, gathers=phases,
            root=schedule.root.sharded_numel, units=[u.sharded_numel for u in schedule.units[1:]],
        )
        results.append(out)
    return results
