"""Overlap of two half-open index ranges: the one place shard, fragment and parameter ranges
meet (a parameter inside a shard, a saved fragment inside a requested range, a Muon matrix
inside a master)."""

from __future__ import annotations


def overlap(start_a: int, stop_a: int, start_b: int, stop_b: int) -> tuple[int, int] | None:
    """[lo, hi) common to [start_a, stop_a) and [start_b, stop_b), or None if they are disjoint."""
    lo = max(start_a, start_b)
    hi = min(stop_a, stop_b)
    return (lo, hi) if lo < hi else None
