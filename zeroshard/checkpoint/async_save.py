"""Asynchronous saves: the files are written by a background thread while training continues.

[Note: asynchronous saves]
`save_checkpoint` with `checkpoint.writer.decoupled` (or `async_save=True`) does its collective
part in the caller's thread, as a synchronous save does: agree on the tag, create the
temporary directory, copy every rank's shards to host memory (pinned for tensors on a GPU;
the buffers are kept and reused by the next save), gather what the index needs. Then it returns,
and one writer thread per rank writes the files:

- every rank writes and fsyncs its `rank_<r>.safetensors`, then announces it with a
  done-marker `.rank_<r>.done` in the temporary directory (renamed into place, so it is
  either absent or complete; it carries the file's size and sha256 for the index);
- rank 0's writer waits on the file system for every other rank's marker, then writes the
  index last, renames the directory into place and moves `latest`, as a synchronous save
  does. So `latest` names a tag only after every rank's files are durable.

Why markers on the file system, not a collective: a collective from the writer thread would
interleave with the training step's collectives on the same process group (their order
must match across ranks), and one at the next step boundary would stall training on the
slowest writer. The save directory is already one every rank sees, so a marker costs one
small file. Rank 0 gives up after `zeroshard.collective_timeout_s` (a rank that died never
writes its marker), and a rank whose writer failed writes `.rank_<r>.failed` instead, so
rank 0 stops waiting at once.

Why a thread, not a process: the work is file writes, hashing and fsync, which release the
GIL; the host copies are shared with the thread as they are (a process would need them
copied again into shared memory or pickled); and an error is an exception object the
waiting call raises. A kill -9 of the rank kills the writer with it, which leaves only the
temporary directory, as a killed synchronous save does.

The next `save_checkpoint`, `load_checkpoint`, `engine.resume_latest()`, `engine.destroy()` and
`engine.wait_for_checkpoint()` wait for the writer and agree on its outcome across ranks
(one small all-gather): if any rank's writer failed, every rank raises a CheckpointError
naming the rank and the cause. Readers that are not collectives (the fp32 consolidation,
DeepSpeed's zero_to_fp32 functions, the DeepSpeed converters) wait for this process's writer
without the agreement (`join_writer`), so they read the save just made, not the one before.
At interpreter exit the (non-daemon) writer thread is joined and a failure is logged as an error.
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.files import remove_entry, write_text_atomic
from zeroshard.checkpoint.format import CheckpointError, read_utf8
from zeroshard.checkpoint.sync import all_gather_object, describe
from zeroshard.checkpoint.write import UNFINISHED, Rank0State, publish, write_rank0_files, write_rank_file
from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S

logger = logging.getLogger("zeroshard")

# Test hook: called by the writer thread as WRITER_HOOK(point, rank) at "start", "rank_file"
# (its file is written and fsynced, the marker not yet), "all_ranks" (rank 0: every marker
# seen), "before_rename" (rank 0: the index is written) and "published" (rank 0).
WRITER_HOOK: Callable[[str, int], None] | None = None

_POLL_MAX_S = 0.1


def done_marker(tmp: Path, rank: int) -> Path:
    return tmp / f".rank_{rank:05d}.done"


def failed_marker(tmp: Path, rank: int) -> Path:
    return tmp / f".rank_{rank:05d}.failed"


def decoupled(engine: Any) -> bool:
    """`checkpoint.writer.decoupled` of the engine's config (either form of the section)."""
    section = getattr(engine.config, "checkpoint", None)
    writer = section.get("writer") if isinstance(section, dict) else getattr(section, "writer", None)
    if writer is None:
        return False
    return bool(writer.get("decoupled", False) if isinstance(writer, dict) else writer.decoupled)


# ------------------------------------------------------------------------ host copies

# Host buffers of the last asynchronous save, reused by the next one: a fresh allocation of
# the size of a shard costs page faults on every save (pinning, for GPU tensors, is slower
# still). Only touched between saves, when no writer is running (each save waits first).
_HOST_BUFFERS: list[torch.Tensor] = []


class _HostCopy:
    """`to_host` for `save.rank_tensors`: a copy in host memory that training cannot change.
    Tensors on a GPU go to pinned buffers without blocking; `finish()` waits for those copies."""

    def __init__(self) -> None:
        self.used = 0
        self.streams: set[Any] = set()

    def _buffer(self, tensor: torch.Tensor, pin: bool) -> torch.Tensor:
        kept = _HOST_BUFFERS[self.used] if self.used < len(_HOST_BUFFERS) else None
        if kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype or kept.is_pinned() != pin:
            kept = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            if self.used < len(_HOST_BUFFERS):
                _HOST_BUFFERS[self.used] = kept
            else:
                _HOST_BUFFERS.append(kept)
        self.used += 1
        return kept

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "cpu":
            return self._buffer(tensor, pin=False).copy_(tensor)
        if tensor.device.type != "cuda":
            return tensor.to("cpu", copy=True)
        buffer = self._buffer(tensor, pin=True)
        buffer.copy_(tensor, non_blocking=True)
        self.streams.add(torch.cuda.current_stream(tensor.device))
        return buffer

    def finish(self) -> None:
        for stream in self.streams:
            stream.synchronize()
        del _HOST_BUFFERS[self.used :]


def host_copy() -> _HostCopy:
    return _HostCopy()


# --------------------------------------------------------------------------- the writer


@dataclass
class WriteJob:
    """One rank's part of one asynchronous save, and what became of it."""

    save_dir: Path
    tag: str
    tmp: Path
    rank: int
    world_size: int
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    rank0: Rank0State | None
    save_latest: bool
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    error: BaseException | None = None
    abort: threading.Event = field(default_factory=threading.Event)
    abort_reason: str = ""
    thread: threading.Thread | None = None

    @property
    def name(self) -> str:
        return f"the asynchronous save of {self.save_dir / self.tag}"


def _hook(point: str, job: WriteJob) -> None:
    if WRITER_HOOK is not None:
        WRITER_HOOK(point, job.rank)


def _wait_for_ranks(job: WriteJob, own: dict[str, Any]) -> list[dict[str, Any]]:
    """Rank 0: every rank's file entry, from the markers, in rank order."""
    entries = {0: own}
    deadline = time.monotonic() + job.timeout_s
    delay = 0.002
    while True:
        for rank in range(1, job.world_size):
            if rank in entries:
                continue
            failed = failed_marker(job.tmp, rank)
            if failed.is_file():
                raise CheckpointError(f"rank {rank}'s writer failed: {read_utf8(failed).strip()}")
            done = done_marker(job.tmp, rank)
            if done.is_file():
                entries[rank] = json.loads(read_utf8(done))
        if len(entries) == job.world_size:
            return [entries[rank] for rank in range(job.world_size)]
        if job.abort.wait(delay):
            raise CheckpointError(job.abort_reason)
        if time.monotonic() > deadline:
            missing = sorted(set(range(job.world_size)) - set(entries))
            raise CheckpointError(
                f"rank(s) {missing} did not announce their files in {job.tmp} within {job.timeout_s:g} s "
                "(zeroshard.collective_timeout_s); a rank died or its writer is stuck. The checkpoint "
                "was not published; `latest` names the previous one."
            )
        delay = min(2 * delay, _POLL_MAX_S)


def _run(job: WriteJob) -> None:
    try:
        _hook("start", job)
        own = write_rank_file(job.tmp, job.rank, job.tensors, job.metadata)
        _hook("rank_file", job)
        if job.rank != 0:
            write_text_atomic(done_marker(job.tmp, job.rank), json.dumps(own))
            return
        entries = _wait_for_ranks(job, own)
        _hook("all_ranks", job)
        for rank in range(1, job.world_size):
            remove_entry(done_marker(job.tmp, rank))
        write_rank0_files(job.tmp, job.rank0, entries)
        _hook("before_rename", job)
        publish(job.save_dir, job.tag, job.tmp, job.save_latest)
        UNFINISHED.discard(job.tmp.absolute())
        logger.info("saved checkpoint %s (asynchronously, world size %d)", job.save_dir / job.tag, job.world_size)
        _hook("published", job)
    except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread by wait_for_checkpoint
        if isinstance(exc, CheckpointError):
            job.error = exc
        else:
            job.error = CheckpointError(f"writing {job.tmp}: {describe(exc)}")
            job.error.__cause__ = exc
        if job.rank != 0:
            try:  # rank 0 stops waiting for this rank's marker
                write_text_atomic(failed_marker(job.tmp, job.rank), describe(exc) + "\n")
            except OSError:
                pass  # rank 0 learns it at the wait, or after its timeout


_PENDING: WriteJob | None = None


def start(job: WriteJob, copy: _HostCopy) -> None:
    """Hand `job` to a new writer thread, once the host copies are complete."""
    global _PENDING
    copy.finish()
    # Not a daemon: interpreter exit joins it, so a script's last save is written.
    job.thread = threading.Thread(target=_run, args=(job,), name=f"zeroshard-checkpoint-writer[{job.tag}]")
    _PENDING = job
    job.thread.start()


def pending() -> bool:
    """Whether this process has an asynchronous save not yet waited for."""
    return _PENDING is not None


def join_writer() -> None:
    """Wait until this process's writer thread (if any) has finished, without a collective: for
    readers that run on one rank. The outcome is still agreed by the next `wait_for_checkpoint`.
    Bounded: rank 0's writer gives up after `zeroshard.collective_timeout_s`."""
    job = _PENDING
    if job is not None and job.thread is not None:
        job.thread.join()


def wait_for_checkpoint(what: str = "wait_for_checkpoint()") -> None:
    """Wait until this process's asynchronous save is written and published; collective when
    one is pending (every rank has one then: saves are collective), a no-op otherwise.

    Raises:
        CheckpointError: on every rank, when any rank's writer failed (names the rank and the
            cause); `latest` then still names the previous checkpoint.
    """
    global _PENDING
    job = _PENDING
    if job is None:
        return
    _PENDING = None
    if job.rank != 0:
        job.thread.join()
    # Rank 0's writer may be waiting for the marker of a rank whose writer failed without
    # writing one; the other ranks' outcomes tell it to stop.
    outcomes = all_gather_object(None if job.rank == 0 or job.error is None else str(job.error))
    failed = {rank: message for rank, message in enumerate(outcomes) if message is not None}
    if job.rank == 0:
        if failed:
            job.abort_reason = "; ".join(f"rank {rank}'s writer failed: {message}" for rank, message in failed.items())
            job.abort.set()
        job.thread.join()
    outcomes = all_gather_object(None if job.error is None else str(job.error))
    failed = {rank: message for rank, message in enumerate(outcomes) if message is not None}
    if failed:
        details = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        raise CheckpointError(
            f"{job.name} failed on rank(s) {sorted(failed)} (found by {what}): {details}. The checkpoint "
            "was not published; `latest` names the previous one."
        ) from job.error


@atexit.register
def _report_at_exit() -> None:
    """The writer thread has been joined by now (threads are joined before atexit handlers)."""
    job = _PENDING
    if job is not None and job.thread is not None and not job.thread.is_alive() and job.error is not None:
        logger.error("%s failed: %s; `latest` names the previous checkpoint.", job.name, job.error)
