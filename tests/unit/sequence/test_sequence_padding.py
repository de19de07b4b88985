"""zeroshard.sequence.padding's bookkeeping, single process: which positions of each rank's equal
slice are real, the valid-length context, and the refusals. (The wrappers that use it are
checked against single-device results in tests/dist/sequence/test_autosp.py.)"""

from __future__ import annotations

import pytest

from zeroshard.comm.collectives import Group
from zeroshard.sequence.padding import current_valid_length, padded_length, padded_sequence, real_positions


def _rank(r: int, world: int) -> Group:
    return Group(tuple(range(world)), r)


@pytest.mark.parametrize(
    ("valid", "world", "expected"),
    [(13, 4, [4, 4, 4, 1]), (7, 2, [4, 3]), (5, 4, [2, 2, 1, 0]), (8, 4, [2, 2, 2, 2])],
)
def test_real_positions_per_rank(valid: int, world: int, expected: list[int]) -> None:
    local = padded_length(valid, world) // world
    assert [real_positions(local, valid, _rank(r, world)) for r in range(world)] == expected
    assert sum(expected) == valid


def test_no_valid_length_means_every_position() -> None:
    assert real_positions(3, None, _rank(1, 2)) == 3


def test_valid_length_context_nests_and_resets() -> None:
    assert current_valid_length() is None
    with padded_sequence(13):
        with padded_sequence(7):
            assert current_valid_length() == 7
        assert current_valid_length() == 13
    assert current_valid_length() is None


def test_refusals() -> None:
    with pytest.raises(ValueError, match=r"valid_length=-1: must be >= 0"):
        with padded_sequence(-1):
            pass
    with pytest.raises(ValueError, match=r"valid_length=9: more than the 8 positions the 2 slices of 4 hold"):
        real_positions(4, 9, _rank(0, 2))
