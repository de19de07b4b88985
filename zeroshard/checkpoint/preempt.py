"""Preemption: the ranks agree to stop, save one checkpoint together and exit with the status
that asks the scheduler to run the job again (the `preemption` config section,
zeroshard/config/preemption.py; docs/cluster.md).

[Note: agreeing to stop]
A signal reaches one rank (Slurm's `--signal` the batch step's processes, a node's kubelet its
pod, a user's `kill` one pid). The handler only sets this process's flag
(zeroshard/launch/signals.py). Each optimizer step already all-reduces a packed vector over
the world (the gradient norm, the non-finite flags and the ranks' positions,
step/optimizer_step.py); one more slot carries each rank's flag, so after every step all ranks
hold the same answer with no extra round trip, at every stage and precision. A signal that
arrives after a rank packed its vector counts at the next step: the ranks never disagree.
When the answer is yes and `save_dir` is set, every rank saves there (the ordinary collective
`save_checkpoint`) right after the step and raises SystemExit(exit_code); `finally` blocks and
atexit handlers run, the process group is torn down, the launcher sees the status.

Outside a step (an evaluation loop, a data loader waiting for a batch) nothing is lost: the
flag waits for the next step, or `engine.should_stop()` (one small all-reduce, called on every
rank) agrees on it at once.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

import torch

from zeroshard.checkpoint.resume import resume_latest
from zeroshard.comm import collectives as comm
from zeroshard.config.preemption import signal_number
from zeroshard.launch.signals import STOP

logger = logging.getLogger("zeroshard")


class Preemption:
    """The engine's side of preemption (engine.preemption).

    Attributes:
        settings: the config's `preemption` section.
        client_state: what the preemption checkpoint stores as `client_state`: a value, or a
            callable returning one (called at the save), e.g. `lambda: {"epoch": epoch}`.
        resumed: what `"resume": true` loaded at initialize: (path, client_state), or
            (None, None).
        saved: the preemption checkpoint's directory once saved.
    """

    def __init__(self, engine: Any) -> None:
        self.settings = engine.config.preemption
        self.client_state: Any = None
        self.resumed: tuple[str | None, Any] = (None, None)
        self.saved: str | None = None
        self._engine = engine
        self._announced = False
        if self.settings.enabled:
            numbers = [signal_number(name) for name in self.settings.signals]
            if not STOP.install(numbers):
                logger.warning(
                    "preemption: initialize ran outside the main thread (a trainer running the training "
                    "function in a thread); Python installs signal handlers only there, so none were. "
                    "Call zeroshard.launch.signals.STOP.request() when your scheduler asks to stop."
                )
        engine._step.stop_vote = self.vote  # this rank's vote rides in the step's all-reduce
        if self.settings.resume:
            self.resumed = resume_latest(engine, self.settings.save_dir)

    def vote(self) -> bool:
        """Whether this rank was asked to stop (read while packing the step's all-reduce)."""
        if STOP.requested and not self._announced:
            self._announced = True  # ordinary code, not the handler: logging is safe here
            logger.warning(
                "rank %d: received %s; the ranks stop together at the end of this step",
                self._engine.global_rank, STOP.name,
            )
        return STOP.requested

    @property
    def agreed(self) -> bool:
        return bool(self._engine._step.stop_agreed)

    def should_stop(self) -> bool:
        """Whether any rank was asked to stop; collective (every rank calls it, as step())."""
        engine = self._engine
        if self.agreed:
            return True
        flag = torch.tensor([1.0 if self.vote() else 0.0], device=engine.device)
        comm.all_reduce(flag, group=engine.layout.world, tag="preemption")
        if float(flag) > 0:
            engine._step.stop_agreed = True
        return self.agreed

    def after_step(self) -> None:
        """After an optimizer step (never between micro-steps: their gradients are not saved),
        where the ranks agreed: save and exit (with `save_dir` set)."""
        if self.agreed and self.settings.save_dir is not None and self.saved is None:
            self.save_and_exit()

    def save_and_exit(self) -> None:
        """Save the preemption checkpoint on every rank, then SystemExit(exit_code); collective."""
        engine, settings = self._engine, self.settings
        if settings.save_dir is None:
            raise ValueError(
                "save_and_exit(): preemption.save_dir is not set; set it in the config, or save "
                "with engine.save_checkpoint(...) yourself and exit."
            )
        pending = engine.accumulation
        if pending.backward_count != pending._backwards_at_last_step:
            raise RuntimeError(
                "save_and_exit(): called between the micro-steps of a gradient accumulation; their "
                "gradients are not part of a checkpoint. Call it after the engine.step() that ends "
                "the accumulation (engine.is_gradient_accumulation_boundary() was true)."
            )
        state = self.client_state() if callable(self.client_state) else self.client_state
        # Synchronous, whatever checkpoint.writer says: the process exits right after, and an
        # asynchronous save still being written is waited for first (checkpoint/async_save.py).
        self.saved = engine.save_checkpoint(settings.save_dir, tag=settings.tag, client_state=state, async_save=False)
        if engine.global_rank == 0:
            logger.warning(
                "preemption: saved %s at step %d; exiting with status %d (start the job again to resume)",
                self.saved, engine.global_steps, settings.exit_code,
            )
        # From here on a signal must not kill the process by the default action (a status of
        # -15, not exit_code): the launcher SIGTERMs the remaining workers as soon as the first
        # one exits, while they are still in `finally` blocks, atexit or interpreter shutdown.
        STOP.ignore({*(signal_number(name) for name in settings.signals), signal.SIGTERM})
        raise SystemExit(settings.exit_code)
