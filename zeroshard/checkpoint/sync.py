"""Cross-rank agreement for checkpoint I/O: every rank succeeds together or fails together.

Saving and loading are collective, but the work in between is local file I/O that can fail
on one rank only (a full disk, a missing file). A rank that raised while the others wait in
the next collective would hang the job, so each phase ends with `agree`: an all-gather of
every rank's outcome, after which all ranks raise if any rank failed.
"""

from __future__ import annotations

from typing import Any

from zeroshard.checkpoint.format import CheckpointError
from zeroshard.comm import collectives as comm
from zeroshard.sharding.layout import current_layout


def all_gather_object(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order ([obj] without a process group). Checkpoint I/O
    is agreed over the whole world: every rank reads and writes its files."""
    return comm.all_gather_object(obj, group=current_layout().world)


def is_rank_zero() -> bool:
    """Whether this process is rank 0 (or the only process)."""
    return comm.rank() == 0


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def agree(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if `error` is set on any rank.

    The failing rank re-raises its own error; the others raise a CheckpointError that
    names the failing ranks and their messages.
    """
    outcomes = all_gather_object(None if error is None else describe(error))
    failed = {rank: message for rank, message in enumerate(outcomes) if message is not None}
    if not failed:
        return
    if error is not None:
        raise error
    details = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failed.items()))
    raise CheckpointError(f"{what} failed on rank(s) {sorted(failed)}: {details}")
