"""Sequence-parallel exchanges agree their shapes first (world 2, gloo).

Ulysses' all-to-alls are sized by each rank's own tensors. Ranks holding different local
sequence lengths or batches (each rank loading its own dynamically padded batch) used to die
with SIGABRT inside gloo; now every rank raises the same ValueError naming the exchange and
every rank's shapes, and the process group stays usable. `gather_sequence` lets the sequence
lengths differ (by design) but not the other dimensions. Equal shapes are covered by
test_sequence_layer.py, test_sequence_hf.py and test_autosp.py, unchanged.
"""

from __future__ import annotations

import pytest

from tests.dist.scenarios.sequence_shapes import mismatched_shapes

WORLD, TIMEOUT_S = 2, 120
EXCHANGES = ("DistributedAttention", "_SeqAllToAll", "UlyssesSPAttentionHF")


@pytest.fixture(scope="module")
def runs(dist_pool):
    pool = dist_pool(WORLD)
    return {
        "lengths": pool.run(mismatched_shapes, (4, 10), (2, 2), timeout=TIMEOUT_S),
        "batches": pool.run(mismatched_shapes, (4, 4), (2, 3), timeout=TIMEOUT_S),
    }


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_ulysses_with_different_local_lengths_raises_on_every_rank(runs, exchange) -> None:
    messages = [r[exchange] for r in runs["lengths"]]
    assert messages[0] == messages[1]  # the same error everywhere
    assert "over ranks [0, 1]: the ranks hold different shapes (rank 0: " in messages[0]
    longer = "[2, 4, 10, 8]" if exchange == "UlyssesSPAttentionHF" else "[2, 10, 4, 8]"  # [b, h, s, d] there
    assert "[2, 4, 4, 8]" in messages[0] and longer in messages[0]
    assert "equal slice of the same samples" in messages[0]
    assert all(r["after"] == 2.0 for r in runs["lengths"])


@pytest.mark.parametrize("exchange", EXCHANGES)
def test_ulysses_with_different_batches_raises_on_every_rank(runs, exchange) -> None:
    messages = [r[exchange] for r in runs["batches"]]
    assert messages[0] == messages[1]
    assert "[2, 4, 4, 8]" in messages[0] and "[3, 4, 4, 8]" in messages[0]


def test_gather_sequence_allows_other_lengths_but_not_other_batches(runs) -> None:
    assert [r["gather_sequence"] for r in runs["lengths"]] == ["no error"] * WORLD
    messages = [r["gather_sequence"] for r in runs["batches"]]
    assert messages[0] == messages[1]
    assert messages[0].startswith(
        "gather_sequence along dim 1 over ranks [0, 1]: the slices differ in another dimension "
        "(rank 0: [2, 4, 4, 8]; rank 1: [3, 4, 4, 8])"
    )
    assert all(r["after"] == 2.0 for r in runs["batches"])
