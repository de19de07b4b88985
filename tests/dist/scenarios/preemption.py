"""Rank-side scenarios for tests/dist/checkpoint/test_preemption.py: real signals, sent by a rank
to itself (os.kill) at an exact point, so each case is deterministic.

Each task trains the checkpoint tests' TinyLM, catches the engine's SystemExit (what ends the
process under a launcher) and returns what happened on this rank: the exit status, the step it
stopped at, the checkpoint it saved, and whether that checkpoint, loaded into a fresh engine,
equals an uninterrupted run stopped at the same step (bitwise: same world size). Handlers are
removed and the flag cleared at the end, as the pooled worker lives on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.checkpoint.test_checkpoint_helpers import (
    TinyLM,
    assert_snapshots_equal,
    make_config,
    snapshot,
    train,
)
from zeroshard.checkpoint import async_save as async_save_module
from zeroshard.checkpoint import save as save_module
from zeroshard.checkpoint import write as write_module
from zeroshard.launch.signals import STOP

SIGNALLED = 1  # the rank that receives the signal (rank 0 for "two_signals")


def _engine(stage: int, mode: str, save_dir: str | None, seed: int = 0, extra: dict | None = None, **preemption: Any):
    torch.manual_seed(seed)
    config = {**make_config(stage, mode, dist.get_world_size()), **(extra or {})}
    config["preemption"] = {"enabled": True, "save_dir": save_dir, **preemption}
    engine, *_ = zeroshard.initialize(model=TinyLM(), config=config)
    return engine


def _kill_self(*signums: int) -> None:
    for signum in signums:
        os.kill(os.getpid(), signum)  # delivered before os.kill returns (to the main thread)


def _eval(engine, batches: int, poll: bool) -> int:
    """An evaluation loop (no_grad; at stage 3 every forward gathers: a collective); the signal
    arrives on rank SIGNALLED before its first batch. Returns the batches evaluated."""
    from tests.dist.checkpoint.test_checkpoint_helpers import rank_batch

    engine.eval()
    done = 0
    with torch.no_grad():
        for b in range(batches):
            if b == 0 and dist.get_rank() == SIGNALLED:
                _kill_self(signal.SIGTERM)
            if poll and engine.should_stop():
                break
            engine(*rank_batch(100 + b, 0))
            done += 1
    engine.train()
    return done


def preempted_run(kind: str, stage: int, mode: str, save_dir: str, steps: int = 5) -> dict[str, Any]:
    """Train up to `steps` steps with a signal at the point `kind` names:

    - "mid_step": rank 1, in its forward of step 3's first micro-batch (of two);
    - "mid_save": rank 1, while writing its file of a checkpoint the loop saves after step 2;
    - "mid_async_save": the same with an asynchronous save (checkpoint.writer.decoupled): the
      signal comes from the writer thread, and the preemption save waits for that save;
    - "mid_eval": rank 1, in an evaluation loop after step 2 that polls engine.should_stop()
      (then the loop saves and exits: engine.preemption.save_and_exit());
    - "mid_eval_no_poll": the same loop without polling: the next step boundary handles it;
    - "two_signals": rank 0 gets SIGTERM then SIGUSR1 at once, rank 1 SIGUSR2, in step 3;
    - "before_first_step": rank 1, right after initialize;
    - "before_first_step_poll": the same, and the loop polls should_stop() before training.
    """
    rank = dist.get_rank()
    STOP.clear()
    asynchronous = kind == "mid_async_save"
    writer_module = async_save_module if asynchronous else save_module
    original_writer = writer_module.write_rank_file
    extra = {"checkpoint": {"writer": {"decoupled": True}}} if asynchronous else None
    try:
        engine = _engine(stage, mode, save_dir, extra=extra)
        code, evaluated, user_save = None, None, None
        try:
            if kind.startswith("before_first_step") and rank == SIGNALLED:
                _kill_self(signal.SIGTERM)
            if kind == "before_first_step_poll" and engine.should_stop():
                engine.preemption.save_and_exit()
            for step in range(steps):
                handle = None
                if step == 2 and kind in ("mid_step", "two_signals"):
                    fired: list[bool] = []  # the first forward of the step only

                    def hook(*_: Any, fired: list[bool] = fired) -> None:
                        if not fired:
                            fired.append(True)
                            _signal_in_step(kind, rank)

                    handle = engine.module.register_forward_pre_hook(hook)
                try:
                    train(engine, step, step + 1)
                finally:
                    if handle is not None:
                        handle.remove()
                if step == 1 and kind in ("mid_save", "mid_async_save"):
                    if rank == SIGNALLED:
                        def writer(*args, **kwargs):
                            _kill_self(signal.SIGTERM)
                            return original_writer(*args, **kwargs)

                        writer_module.write_rank_file = writer
                    user_save = engine.save_checkpoint(Path(save_dir) / "user", tag="user2")
                    if not asynchronous:  # the asynchronous writer runs it later, in its thread
                        writer_module.write_rank_file = original_writer
                if step == 1 and kind.startswith("mid_eval"):
                    evaluated = _eval(engine, 3, poll=kind == "mid_eval")
                    if kind == "mid_eval" and engine.should_stop():
                        engine.preemption.save_and_exit()
        except SystemExit as stop:
            code = stop.code
        stopped_at, saved, count = engine.global_steps, engine.preemption.saved, STOP.count
        # The checkpoint against an uninterrupted run stopped at the same step (fresh engines).
        STOP.clear()
        resumed = _engine(stage, mode, None, seed=1)
        path, _ = resumed.resume_latest(save_dir)
        reference = _engine(stage, mode, None)
        train(reference, 0, stopped_at)
        assert_snapshots_equal(snapshot(reference), snapshot(resumed), f"{kind}: the preemption checkpoint")
        if user_save is not None:  # the save the signal interrupted is complete and loads
            check = _engine(stage, mode, None, seed=2)
            check.load_checkpoint(Path(save_dir) / "user", tag="user2")
            partial = _engine(stage, mode, None)
            train(partial, 0, 2)
            assert_snapshots_equal(snapshot(partial), snapshot(check), f"{kind}: the interrupted user save")
        return {"code": code, "stopped_at": stopped_at, "saved": saved, "resumed": path,
                "evaluated": evaluated, "signals": count}
    finally:
        writer_module.write_rank_file = original_writer
        STOP.uninstall()
        STOP.clear()


def _signal_in_step(kind: str, rank: int) -> None:
    if kind == "mid_step" and rank == SIGNALLED:
        _kill_self(signal.SIGTERM)
    elif kind == "two_signals":
        _kill_self(signal.SIGTERM, signal.SIGUSR1) if rank == 0 else _kill_self(signal.SIGUSR2)


def adopted_group_writes_own_files(save_dir: str) -> dict[str, Any]:
    """A process group created before initialize (as Ray Train does: the pool made it): the
    engine uses it, and each rank writes only its own files of a checkpoint."""
    world_before = dist.group.WORLD
    STOP.clear()
    written: list[str] = []
    original = write_module.save_file

    def recording(tensors, path, *args, **kwargs):
        written.append(Path(path).name)
        return original(tensors, path, *args, **kwargs)

    streamed = write_module.StreamedSafetensors

    class RecordingStream(streamed):  # the rank files are streamed (zeroshard/checkpoint/stream.py)
        def __init__(self, path, *args, **kwargs):
            written.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    write_module.save_file = recording
    write_module.StreamedSafetensors = RecordingStream
    try:
        engine = _engine(2, "fp32", save_dir)
        train(engine, 0, 2)
        engine.save_checkpoint(save_dir)
    finally:
        write_module.save_file = original
        write_module.StreamedSafetensors = streamed
        STOP.uninstall()
    return {
        "same_group": dist.group.WORLD is world_before and engine.layout.world.handle in (None, world_before),
        "world_size": engine.world_size,
        "written": written,
    }


def vote_rides_the_step_all_reduce(stage: int, mode: str) -> dict[str, Any]:
    """Two steps recorded, the second with rank 1 asked to stop (no save_dir: nothing automatic):
    the collectives of the two steps, and whether each rank knew after each step."""
    from zeroshard.comm import collectives as comm

    STOP.clear()
    try:
        engine = _engine(stage, mode, None)
        logs, agreed = [], []
        for step in range(2):
            if step == 1 and dist.get_rank() == 1:
                STOP.request()
            with comm.recording() as log:
                train(engine, step, step + 1)
            logs.append([(r.op, r.tag, r.numel) for r in log.records])
            agreed.append(engine.preemption.agreed)
        return {"logs": logs, "agreed": agreed, "code": None}
    finally:
        STOP.uninstall()
        STOP.clear()
