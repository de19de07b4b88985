"""What the engine tells the hang watchdog: the calls it runs (its phases), the channels of its
groups, and the watchdog's timeouts (zeroshard/comm/progress.py, channels.py, watchdog.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from zeroshard.comm import collectives as comm
from zeroshard.comm import progress, watchdog

if TYPE_CHECKING:
    from zeroshard.engine.engine import Engine

__all__ = ["call", "start_watching", "timeouts_of"]


@contextlib.contextmanager
def call(engine: Engine, name: str) -> Iterator[None]:
    """The engine runs `name` (forward, evaluation, backward, step, save, load) in the block."""
    steps_before = engine.global_steps
    with progress.phase(name, steps_before, engine.micro_steps):
        yield
    if name == "step" and engine.global_steps != steps_before:
        progress.state.step_completed()


def forward_call(engine: Engine) -> str:
    """ "forward" for a training forward, "evaluation" for one without grad or in eval mode."""
    return "forward" if engine.module.training and torch.is_grad_enabled() else "evaluation"


def timeouts_of(engine: Engine) -> watchdog.Timeouts:
    extras = engine.config.zeroshard
    return watchdog.resolve_timeouts(
        extras.hang_timeout_s, extras.hang_first_step_timeout_s, extras.collective_timeout_s
    )[0]


def start_watching(engine: Engine) -> None:
    """Open the channels of the engine's world and stage-3 gathers (collective: every rank builds
    its engines in the same order), then start or reconfigure the process's watchdog."""
    timeout_s = engine.config.zeroshard.collective_timeout_s
    layout = engine.layout
    comm.open_channels(layout.world, timeout_s)
    # Stage 3's parameter gathers, one channel per size ([Note: one transport per phase]); in the
    # same order on every rank: the groups sorted by their ranks.
    sizes: dict[tuple[int, ...], tuple[comm.Group, set]] = {}
    for flat in engine.flats:
        if flat.policy.keep_full_params or flat.spec.shard.size < 2:
            continue
        group = flat.spec.shard
        wire = flat.role.gather_dtype
        sizes.setdefault(group.ranks, (group, set()))[1].add((flat.padded_numel // flat.shard_size, wire))
    for ranks in sorted(sizes):
        group, wanted = sizes[ranks]
        comm.open_gather_channels(group, sorted(wanted, key=str), timeout_s)
    watchdog.start(timeouts_of(engine), comm.backend_name(layout.world))
