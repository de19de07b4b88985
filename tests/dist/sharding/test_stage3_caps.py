"""DeepSpeed's stage-3 memory caps, honoured (issue 30 item 9), at world 2 on the TinyModel:

* `stage3_max_live_parameters` bounds the elements that prefetching and keeping for reuse hold
  gathered; the gathers a unit needs are never refused (with a cap below the root's size:
  the root and the running unit, nothing more);
* `stage3_max_reuse_distance`: a unit whose next use in the last iteration's order comes
  within that many elements stays gathered from its forward to its backward, so the backward
  gathers only the root again; 0 (zeroshard's default) frees every unit after each use.

Every setting trains the same maths: each run is checked against the single-process fp32
reference with the fp32 tolerances of tests/dist/reference.py (the caps move gathers, never a
value)."""

from __future__ import annotations

from tests.dist.reference import check_against_reference, reference_for, run_all, world_losses
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.stage3_caps import run_caps

# A prefetch bucket of one element: the next unit only (the TinyModel's units are 304 elements).
PREFETCH = {"stage3_prefetch_bucket_size": 1}
SETTINGS = [
    ("default", PREFETCH),
    ("live-cap", {**PREFETCH, "stage3_max_live_parameters": 1}),  # no prefetch, nothing kept
    ("reuse", {**PREFETCH, "stage3_max_reuse_distance": 1_000_000_000}),  # DeepSpeed's default
    ("reuse-capped", {**PREFETCH, "stage3_max_reuse_distance": 1_000_000_000, "stage3_max_live_parameters": 1}),
]


def test_caps_bound_memory_and_keep_the_maths(dist_pool) -> None:
    per_rank = dist_pool(2).run(run_caps, SETTINGS, timeout=300)
    ref = reference_for(Case(stage=3), 2)
    checks = []
    for index, (label, _) in enumerate(SETTINGS):
        result = per_rank[0][index]
        checks.append((label, lambda r=result, i=index, lb=label: check_against_reference(
            r, ref, "fp32", Case(stage=3).settings, world_losses(per_rank, i), lb)))
    run_all(checks)

    runs = {label: per_rank[0][i] for i, (label, _) in enumerate(SETTINGS)}
    for rank_results in per_rank:  # every rank issues the same gathers (they are collectives)
        assert [r["gathers"] for r in rank_results] == [r["gathers"] for r in per_rank[0]]
    base, capped, reuse, both = runs["default"], runs["live-cap"], runs["reuse"], runs["reuse-capped"]
    largest, root = max(base["units"]), base["root"]
    # The cap of 1 element stops every prefetch: the root and the unit running, no more.
    assert capped["peak"] == root + largest, capped["peak"]
    assert capped["peak"] < base["peak"], (capped["peak"], base["peak"])
    # The default prefetches the next unit: the root and two units at most.
    assert base["peak"] == root + 2 * largest, base["peak"]
    # The cap only moves gathers from prefetch to use: as many, none saved.
    assert capped["gathers"] == base["gathers"]
    # Kept for reuse (every unit is within 1e9 elements of its backward): after the first
    # step (no trace yet, as in DeepSpeed, so nothing is kept) the backward gathers only the
    # root again, and every unit is held at once; the forwards are unchanged.
    assert reuse["gathers"]["forward"] == base["gathers"]["forward"]
    assert reuse["gathers"]["backward"] == [base["gathers"]["backward"][0], 1, 1], reuse["gathers"]
    assert reuse["peak"] == root + sum(base["units"]), reuse["peak"]
    # The live cap wins over the reuse distance: nothing kept, the capped run's gathers and peak.
    assert both["gathers"] == capped["gathers"] and both["peak"] == capped["peak"]
