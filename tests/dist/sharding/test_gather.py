"""The one all-gather (zeroshard/sharding/gather.py): bounded buckets in flight at stages 1-2."""

from __future__ import annotations

import pytest

from tests.dist.scenarios.gather import publish_in_flight


@pytest.mark.parametrize("stage", [1, 2])
def test_publish_keeps_at_most_two_buckets_in_flight(dist_pool, stage: int) -> None:
    """A 1244-element model published in buckets of 200 elements (100 columns on 2 ranks):
    at least 7 all-gathers, never more than two issued and not yet completed."""
    for counts in dist_pool(2).run(publish_in_flight, stage, 200, timeout=300):
        assert counts["issued"] >= 7, counts
        assert counts["outstanding"] == 0, counts
        assert counts["most"] == 2, counts
