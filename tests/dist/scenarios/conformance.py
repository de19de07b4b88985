"""Rank-side scenarios for tests/dist/engine/test_conformance.py."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.reference import ProbeModel
from tests.dist.scenarios.common import Case, build_engine, full_masters, train
from zeroshard.zero import GatheredParameters


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Train every case in turn with the DeepSpeed loop; one result per case."""
    return [train(build_engine(case), case) for case in cases]


# Probe inputs (see test_accumulation_dtype_is_real): micro-step 0 gives every rank a
# gradient of 1.0, the other micro-steps 2**-9 each. 1 + 2**-9 is exact in fp32 but rounds
# back to 1 in bf16 (its ulp at 1 is 2**-7), so bf16 accumulation loses the small ones.
PROBE_LARGE = 1.0
PROBE_SMALL = 2.0**-9


def probe_input(micro_step: int, size: int = 4) -> torch.Tensor:
    return torch.full((size,), PROBE_LARGE if micro_step == 0 else PROBE_SMALL)


def accumulation_probe(cases: list[Case], use_no_sync: bool = False) -> list[dict[str, Any]]:
    """For each case: one optimizer step of ProbeModel; the reduced gradient and the
    dtypes of the "grad" collectives.

    Args:
        cases: stage, mode and ga (micro is unused: the input is one vector per micro-step).
        use_no_sync: run every micro-step but the last under `engine.no_sync()`.
    """
    results = []
    for case in cases:
        engine = build_engine(case, model=ProbeModel())
        with zeroshard.comm.recording() as log:
            for j in range(case.ga):
                quiet = engine.no_sync() if use_no_sync and j < case.ga - 1 else contextlib.nullcontext()
                with quiet:
                    loss = engine(probe_input(j))
                    engine.backward(loss)
                if j < case.ga - 1:
                    engine.step()
        grad = zeroshard.safe_get_full_grad(engine.module.w)
        engine.step()
        results.append(
            {
                "grad": grad,
                "grad_dtypes": sorted({str(r.dtype) for r in log.records if r.tag == "grad"}),
                "world_size": dist.get_world_size(),
            }
        )
    return results


def gathered_parameters_round_trip(cases: list[Case]) -> list[dict[str, Any]]:
    """After one step: masters before and after a `GatheredParameters(modifier_rank=0)` block
    that changes nothing, and the full parameters seen inside a read-only block."""
    results = []
    for case in cases:
        engine = build_engine(case)
        train(engine, case)
        before = full_masters(engine)
        params = list(engine.module.named_parameters())
        with GatheredParameters([p for _, p in params]):
            seen = {name: p.detach().clone() for name, p in params}
        with GatheredParameters([p for _, p in params], modifier_rank=0):
            pass
        after = full_masters(engine)
        results.append({"before": before, "seen": seen, "after": after})
    return results
