"""Rank-side scenarios for tests/dist/sharding/test_gather.py."""

from __future__ import annotations

from typing import Any

from tests.dist.reference import global_batches
from tests.dist.scenarios.common import Case, build_engine, engine_loop_step
from zeroshard.comm import collectives as comm


def publish_in_flight(stage: int, bucket_numel: int) -> dict[str, Any]:
    """One optimizer step with `allgather_bucket_size = bucket_numel`: how many parameter
    all-gathers were issued and the most that were in flight (issued, not yet waited) at once."""
    case = Case(stage=stage, micro=2, steps=1, extra={"zero_optimization": {"allgather_bucket_size": bucket_numel}})
    engine = build_engine(case)
    counts = {"issued": 0, "outstanding": 0, "most": 0}
    real = comm.all_gather

    class Counted:
        def __init__(self, work) -> None:
            self.work = work

        def wait(self):
            counts["outstanding"] -= 1
            return self.work.wait()

    def counting(output, input, *, group, tag="", async_op=False):
        work = real(output, input, group=group, tag=tag, async_op=async_op)
        if tag != "param" or not async_op or work is None:
            return work
        counts["issued"] += 1
        counts["outstanding"] += 1
        counts["most"] = max(counts["most"], counts["outstanding"])
        return Counted(work)

    comm.all_gather = counting
    try:
        batch = global_batches(case.seed, 1, 2 * case.micro)[0]
        engine_loop_step(engine, case, batch)
        engine.step()
    finally:
        comm.all_gather = real
    return counts
