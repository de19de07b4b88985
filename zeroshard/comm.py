"""The only caller of torch.distributed collectives, and the collective recorder.

Every collective the engine issues goes through one of the four functions below, so that
`recording()` sees all of them with the dtype that actually went on the wire. With a world
size of 1 (no process group) the collectives are the identity and nothing is recorded:
no bytes cross a wire.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveRecord",
    "CollectiveLog",
    "recording",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "world_size",
    "rank",
]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as it went on the wire.

    Attributes:
        op: "all_reduce", "reduce_scatter", "all_gather" or "broadcast".
        dtype: the dtype of the tensors sent.
        numel: elements of the full, unsharded buffer (the reduce-scatter input, the
            all-gather output).
        bytes: numel times the element size.
        tag: what the engine used it for ("grad", "param", "norm", "overflow", ...).
        via: the collective that carried it out when that is another one (on gloo a
            reduce-scatter runs as an all-reduce, see `reduce_scatter`); "" otherwise.
    """

    op: str
    dtype: torch.dtype
    numel: int
    bytes: int
    tag: str = ""
    via: str = ""


class CollectiveLog:
    """What `recording()` yields: `records` grows while the block runs."""

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def total_bytes(self, op: str | None = None, tag: str | None = None) -> int:
        return sum(
            r.bytes
            for r in self.records
            if (op is None or r.op == op) and (tag is None or r.tag == tag)
        )


_active_logs: list[CollectiveLog] = []


@contextlib.contextmanager
def recording() -> Iterator[CollectiveLog]:
    """Record every collective the engine issues inside the block.

    Example:
        with zeroshard.comm.recording() as log:
            engine.backward(engine(batch)); engine.step()
        print({(r.op, r.dtype) for r in log.records})
    """
    log = CollectiveLog()
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def _record(op: str, tensor: torch.Tensor, numel: int, tag: str, via: str = "") -> None:
    if not _active_logs:
        return
    rec = CollectiveRecord(op, tensor.dtype, numel, numel * tensor.element_size(), tag, via)
    for log in _active_logs:
        log.records.append(rec)


def world_size(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def rank(group=None) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


def all_reduce(
    tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None, tag: str = "", async_op: bool = False
):
    """In-place all-reduce of `tensor` (summed unless `op` says otherwise).

    Returns `tensor`, or with `async_op` a handle to `wait()` on (None if nothing to wait for).
    """
    if world_size(group) == 1:
        return None if async_op else tensor
    _record("all_reduce", tensor, tensor.numel(), tag)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else tensor


class _CopyAfterWait:
    """A collective's handle whose `wait()` also copies its result where the caller wants it."""

    def __init__(self, work, source: torch.Tensor, target: torch.Tensor) -> None:
        self._work, self._source, self._target = work, source, target

    def wait(self) -> bool:
        self._work.wait()
        self._target.copy_(self._source)
        return True


def _reduce_scatter_runs_as_all_reduce(group) -> bool:
    """On gloo an all-reduce of the whole buffer beats its reduce-scatter: the reduce-scatter
    took 1.1-2.4x as long at 0.2-10 M elements on 2 ranks (benchmarks/collectives.py,
    docs/benchmarks.md).
    NCCL's reduce-scatter moves half the bytes of its all-reduce, so it is used there."""
    return dist.get_backend(group) == "gloo"


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group=None, tag: str = "", async_op: bool = False
):
    """Sum `input` (world_size x len(output) elements) over ranks; keep this rank's chunk.

    `input` is scratch: on gloo the sum is an all-reduce in place in `input` (faster there,
    see `_reduce_scatter_runs_as_all_reduce`), so its contents afterwards are unspecified.
    Returns `output`, or with `async_op` a handle to `wait()` on (None if nothing to wait for).
    """
    ws = world_size(group)
    if ws == 1:
        output.copy_(input.view(-1))
        return None if async_op else output
    assert input.numel() == output.numel() * ws, "reduce_scatter sizes disagree"
    if _reduce_scatter_runs_as_all_reduce(group):
        _record("reduce_scatter", input, input.numel(), tag, via="all_reduce")
        flat_input = input.view(-1)
        mine = flat_input.view(ws, -1)[dist.get_rank(group)]
        work = dist.all_reduce(flat_input, group=group, async_op=True)
        handle = _CopyAfterWait(work, mine, output)
        if async_op:
            return handle
        handle.wait()
        return output
    _record("reduce_scatter", input, input.numel(), tag)
    work = dist.reduce_scatter_single(output, input.view(-1), group=group, async_op=async_op)
    return work if async_op else output


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group=None, tag: str = "", async_op: bool = False
):
    """Concatenate every rank's `input` into `output` (world_size x len(input) elements).

    Returns `output`, or with `async_op` a handle whose `wait()` must be called before
    `output` is read (None when there was nothing to wait for).
    """
    ws = world_size(group)
    if ws == 1:
        output.view(-1).copy_(input.view(-1))
        return None if async_op else output
    assert output.numel() == input.numel() * ws, "all_gather sizes disagree"
    _record("all_gather", input, output.numel(), tag)
    work = dist.all_gather_single(output.view(-1), input.view(-1), group=group, async_op=async_op)
    return work if async_op else output


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, tag: str = "") -> torch.Tensor:
    if world_size(group) == 1:
        return tensor
    _record("broadcast", tensor, tensor.numel(), tag)
    dist.broadcast(tensor, src=src, group=group)
    return tensor
