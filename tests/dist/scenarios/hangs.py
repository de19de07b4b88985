"""Rank-side scenarios for tests/dist/comm/test_hang_watchdog.py: training loops in which the
ranks stop moving together the way users' loops do, each ending on every rank with the hang
watchdog's diagnosis (zeroshard/comm/watchdog.py) instead of a gloo abort or a silent hang.

Each task trains with `zeroshard.hang_timeout_s` of a few seconds, catches what the loop
raises, and returns it (type, the diagnosis, seconds from the divergence to the error) instead
of raising. After a diagnosed hang the process group still holds collectives in flight, which
gloo cannot cancel, so the task asks the pool for fresh workers (`discard_workers`).
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.dist.harness import discard_workers
from tests.dist.reference import build_model, global_batches, micro_batch
from zeroshard.comm import progress

# The timeout of the one scenario that needs it (a rank stuck in its data loader: no deadlock,
# the others wait for it). The divergences are deadlocks, named within a few ticks whatever the
# timeout: they run with a longer one (DEADLOCK_HANG_TIMEOUT_S), so that a rank descheduled for
# seconds on a loaded machine before the divergence is not taken for a stuck one.
HANG_TIMEOUT_S = 3.0
DEADLOCK_HANG_TIMEOUT_S = 8.0
# The hard bound the diagnosis must beat by far; long enough that gloo's own timeout never
# fires first on a loaded machine.
COLLECTIVE_TIMEOUT_S = 30.0


def config(stage: int, ga: int = 1, hang_timeout_s: float = DEADLOCK_HANG_TIMEOUT_S) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zeroshard": {"collective_timeout_s": COLLECTIVE_TIMEOUT_S, "hang_timeout_s": hang_timeout_s,
                      "hang_first_step_timeout_s": hang_timeout_s},
    }


class _Outcome:
    """What the loop ended with, timed from the divergence (`diverged()`)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.diverged_at: float | None = None

    def diverged(self) -> None:
        if self.diverged_at is None:
            self.diverged_at = time.monotonic()

    def result(self, error: BaseException | None, **extra: Any) -> dict[str, Any]:
        end = time.monotonic()
        out = {
            "type": None if error is None else type(error).__name__,
            "message": "" if error is None else str(error),
            "diagnosis": getattr(error, "diagnosis", None),
            "seconds": end - (self.diverged_at if self.diverged_at is not None else self.started),
            "verdict": progress.state.verdict,
            **extra,
        }
        if error is not None:
            discard_workers()
        return out


def skip_step(stage: int, bad_rank: int, bad_step: int = 1, steps: int = 4) -> dict[str, Any]:
    """Every rank trains the DeepSpeed loop; `bad_rank` does not call step() after its backward
    of step `bad_step` and carries on with the next batch."""
    engine, *_ = zeroshard.initialize(model=build_model(0), config=config(stage))
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome, error = _Outcome(), None
    try:
        for step, batch in enumerate(global_batches(0, steps, 2 * world)):
            tokens, targets = micro_batch(batch, rank, 0, world, 2)
            engine.backward(engine(tokens, targets))
            if step == bad_step:
                outcome.diverged()
                if rank == bad_rank:
                    continue
            engine.step()
    except Exception as exc:  # the outcome under test
        error = exc
    return outcome.result(error)


def short_then_save(bad_rank: int, steps: int = 3) -> dict[str, Any]:
    """Stage 3: `bad_rank` runs one optimizer step fewer than the others, then every rank
    calls save_checkpoint."""
    engine, *_ = zeroshard.initialize(model=build_model(0), config=config(3))
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome, error = _Outcome(), None
    try:
        for step, batch in enumerate(global_batches(0, steps, 2 * world)):
            if step == steps - 1:
                outcome.diverged()
                if rank == bad_rank:
                    break
            tokens, targets = micro_batch(batch, rank, 0, world, 2)
            engine.backward(engine(tokens, targets))
            engine.step()
        with tempfile.TemporaryDirectory() as directory:
            engine.save_checkpoint(directory)
    except Exception as exc:  # the outcome under test
        error = exc
    return outcome.result(error)


def unequal_micro_batches(bad_rank: int, steps: int = 3) -> dict[str, Any]:
    """Stage 2, gradient_accumulation_steps 2: `bad_rank` runs three micro-batches in step 1
    (forward, backward, step() each, the DeepSpeed loop), the others two; then every rank saves."""
    engine, *_ = zeroshard.initialize(model=build_model(0), config=config(2, ga=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome, error = _Outcome(), None
    try:
        for step, batch in enumerate(global_batches(0, steps, 4 * world)):
            micros = 3 if step == 1 and rank == bad_rank else 2
            for m in range(micros):
                if m == 2:
                    outcome.diverged()
                tokens, targets = micro_batch(batch, rank, m % 2, world, 2)
                engine.backward(engine(tokens, targets))
                engine.step()
        outcome.diverged()
        with tempfile.TemporaryDirectory() as directory:
            engine.save_checkpoint(directory)
    except Exception as exc:  # the outcome under test
        error = exc
    return outcome.result(error)


class UnevenBlocks(nn.Module):
    """Blocks of different widths (each a stage-3 unit of its own size), so that two ranks that
    gather different blocks put different sizes on the wire: gloo aborted both processes on that."""

    def __init__(self, widths: tuple[int, ...] = (16, 24, 32, 40), vocab: int = 13, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, w), nn.Tanh(), nn.Linear(w, dim)) for w in widths)
        self.head = nn.Linear(dim, vocab)
        self.reader: int | None = None  # the rank that reads blocks[1]'s weight directly

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            h = h + block(h)
            if i == 0 and dist.get_rank() == self.reader:
                # A parameter used on one rank only (say, a statistic this rank logs): at stage 3
                # it gathers blocks[1] here, where the other ranks gather blocks[1] too but later.
                h = h + 0.0 * self.blocks[2][0].weight.mean()
        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())


def parameter_on_one_rank(reader: int, steps: int = 2) -> dict[str, Any]:
    """Stage 3: on `reader` the forward also reads blocks[2]'s weight right after blocks[0]
    (the other ranks do not): its gather of a 32-wide block meets the others' gather of the
    24-wide blocks[1]."""
    torch.manual_seed(0)
    model = UnevenBlocks()
    model.reader = reader
    engine, *_ = zeroshard.initialize(model=model, config=config(3))
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome, error = _Outcome(), None
    try:
        for batch in global_batches(0, steps, 2 * world):
            tokens, targets = micro_batch(batch, rank, 0, world, 2)
            outcome.diverged()
            engine.backward(engine(tokens, targets))
            engine.step()
    except Exception as exc:  # the outcome under test
        error = exc
    return outcome.result(error)


def data_loader_sleeps(bad_rank: int, sleep_s: float = 120.0, steps: int = 4) -> dict[str, Any]:
    """Stage 2: `bad_rank`'s data loader blocks (a sleep far past every timeout) before step 2's
    batch; the others go on into the backward and wait there."""
    engine, *_ = zeroshard.initialize(model=build_model(0), config=config(2, hang_timeout_s=HANG_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    outcome, error = _Outcome(), None
    try:
        for step, batch in enumerate(global_batches(0, steps, 2 * world)):
            if step == 2:
                outcome.diverged()
                if rank == bad_rank:
                    time.sleep(sleep_s)  # the data loader's wait
            tokens, targets = micro_batch(batch, rank, 0, world, 2)
            engine.backward(engine(tokens, targets))
            engine.step()
    except Exception as exc:  # the outcome under test
        error = exc
    return outcome.result(error)


def moe_zero_tokens(zero_rank: int, stage: int, steps: int = 3) -> dict[str, Any]:
    """An MoE model without drops (drop_tokens=False), expert-parallel over the world, where
    `zero_rank` holds no token in step 1. Not a hang: every rank still takes part in the
    capacity agreement and the token exchanges. Returns the losses and the watchdog's verdict
    (None: it stayed quiet)."""
    from zeroshard.moe.layer import MoE

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(5, 8)
            expert = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
            self.moe = MoE(8, expert, num_experts=4, ep_size=dist.get_world_size(), k=2, min_capacity=2,
                           drop_tokens=False, top2_2nd_expert_sampling=False)
            self.head = nn.Linear(8, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out, aux, _ = self.moe(self.embed(x))
            # A sum over tokens (finite for zero tokens), not a mean.
            return F.mse_loss(self.head(out), y, reduction="sum") / 16 + 0.01 * aux

    torch.manual_seed(0)
    engine, *_ = zeroshard.initialize(model=Net(), config=config(stage))
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    outcome, error, losses = _Outcome(), None, []
    try:
        for step in range(steps):
            rows = 0 if (step == 1 and rank == zero_rank) else 2
            x, y = torch.randn(rows, 6, 5, generator=generator), torch.randn(rows, 6, 3, generator=generator)
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    except Exception as exc:  # would be a failure of the test
        error = exc
    return outcome.result(error, losses=losses, global_steps=engine.global_steps)
