"""comms_logger and wall_clock_breakdown on two gloo ranks: the collective summary's counts
and bytes are the recorder's, each kind took time, and the breakdown's parts add up to the
step time the loop measured, the reduction wait included."""

from __future__ import annotations

import pytest

from tests.dist.scenarios.common import Case
from tests.dist.scenarios.monitor import comms_and_timers, moe_exchange

INTERVAL = 3


@pytest.mark.parametrize("stage", [2, 3])
def test_comms_summary_is_the_recorder_and_the_breakdown_sums(dist_pool, stage: int) -> None:
    # The flops profiler counts step 1 and times step 2, inside the first interval: its
    # dispatch mode sees stage 3's gathers and the reductions on the way.
    extra = {"comms_logger": {"enabled": True}, "wall_clock_breakdown": True, "steps_per_print": INTERVAL,
             "flops_profiler": {"enabled": True, "profile_step": 1}, "zeroshard": {"peak_tflops": 1.0}}
    case = Case(stage=stage, ga=2, steps=2 * INTERVAL, keep=(), extra=extra)
    for rank, out in enumerate(dist_pool(2).run(comms_and_timers, case, INTERVAL, timeout=240)):
        figures, recorded = out["figures"], out["recorded"]
        assert recorded, rank
        summarised = {key.split("/")[1] for key in figures if key.startswith("comms/")}
        assert summarised == set(recorded), (rank, summarised, recorded)
        for kind, row in recorded.items():
            assert figures[f"comms/{kind}/count"] == row["count"], (rank, kind)
            assert figures[f"comms/{kind}/bytes"] == row["bytes"], (rank, kind)
            assert figures[f"comms/{kind}/time_ms"] > 0, (rank, kind)
            bandwidth = row["bytes"] / (figures[f"comms/{kind}/time_ms"] / 1e3) / 1e9
            assert figures[f"comms/{kind}/bandwidth_GBps"] == pytest.approx(bandwidth, rel=1e-12)
        parts = figures["timers/fwd_ms"] + figures["timers/bwd_ms"] + figures["timers/step_ms"]
        # The loop adds only its own Python between the engine's calls (batch slicing, the
        # loss's .item()): well under 10% of a step on two ranks that wait for each other.
        assert 0.90 * out["loop_ms"] <= parts <= out["loop_ms"] * 1.001, (rank, parts, out["loop_ms"])
        assert figures["timers/bwd_allreduce_ms"] > 0, rank
        if stage == 3:
            assert figures["timers/gather_ms"] > 0, rank
        assert figures["flops/flops_per_step"] > 0 and 0 < figures["flops/mfu"] < 1, (rank, figures)


def test_moe_figures_on_two_expert_parallel_ranks(dist_pool) -> None:
    """On by default: each rank's expert load is its own routes (tokens x k per step, as its
    routers chose them) and the token exchange's all-to-all took time."""
    from tests.dist.scenarios.moe_engine import GA, NUM_EXPERTS, TOKENS

    steps = 2
    for rank, out in enumerate(dist_pool(2).run(moe_exchange, steps, timeout=240)):
        figures = out["figures"]
        for i in range(2):
            load = [figures[f"moe/blocks.{i}.moe/expert{j}_tokens"] for j in range(NUM_EXPERTS)]
            assert sum(load) == TOKENS * GA * 2, (rank, i, load)  # k = 2
            assert load == [c / steps for c in out["chosen"][i].tolist()], (rank, i)
        assert figures["moe/all_to_all_ms"] > 0, rank
