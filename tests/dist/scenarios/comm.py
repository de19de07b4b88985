"""Rank-side scenarios for tests/dist/comm/test_comm_dtypes.py: the collectives of one step."""

from __future__ import annotations

from typing import Any

import zeroshard
from tests.dist.scenarios.common import Case, build_engine, case_batches, engine_loop_step


def record_one_step(cases: list[Case]) -> list[list[tuple[str, str, int, int, str]]]:
    """For each case: every collective of one optimizer step (forward of the first micro-step
    to the boundary `engine.step()`), as (op, dtype, numel, bytes, tag)."""
    results = []
    for case in cases:
        engine = build_engine(case)
        batch = case_batches(case)[0]
        with zeroshard.comm.recording() as log:
            engine_loop_step(engine, case, batch)
            engine.step()
        results.append([(r.op, str(r.dtype).removeprefix("torch."), r.numel, r.bytes, r.tag) for r in log.records])
    return results


def describe_flats(case: Case) -> list[dict[str, Any]]:
    """Debug aid: the engine's flat buffers (unit, role, numel, padded numel)."""
    engine = build_engine(case)
    return [
        {"unit": f.unit_name, "role": f.role.name, "numel": f.numel, "padded": f.padded_numel} for f in engine.flats
    ]
