"""What every checkpoint module shares: the error type and the rank file naming rule.

Kept below format.py and validate.py so that both can use them without importing each other.
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: missing, corrupt, or not for this model."""


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"
