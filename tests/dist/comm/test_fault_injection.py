"""Fault injection: a frozen, dead or lagging peer is an error within a bounded time, never a hang
(issue 13 item 8; docs/reliability.md).

- A peer stopped with SIGSTOP (its connections stay open) or killed with SIGKILL mid-step:
  the survivor raises HangError (a CollectiveError) naming its collective, its group, the step
  and the unit, with the hang watchdog's diagnosis naming the stopped or dead rank, well before
  zeroshard.collective_timeout_s (issue 37; the watchdog's timeout is half of it here, 2 s).
- A no_grad forward on rank 0 only at stage 3: both ranks raise the watchdog's diagnosis,
  naming the all-gather and the unit, instead of torch's 30-minute default.
- A rank that catches an exception in its forward and carries on one batch behind: every
  rank stops at the next step with a RankDesyncError naming the ranks and their positions.

Timeouts here are seconds (TIMEOUT_S) so the whole file runs in well under a minute of waits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.scenarios.common import Case
from tests.dist.scenarios.faults import rank0_only_no_grad_forward, rank_falls_behind

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).resolve().parents[1] / "fault_worker.py"
TIMEOUT_S = 4.0
# Start-up of two processes importing torch on a loaded 2-core machine, plus the timeout.
PROCESS_LIMIT_S = 120.0
# The watchdog's timeout (zeroshard.hang_timeout_s unset: half of the collective timeout) and
# how much later the error may come: the bound, 15 s (the decision takes a few ticks of
# 0.2 s and a heartbeat 1.5 s stale; the machine is shared).
HANG_TIMEOUT_S = TIMEOUT_S / 2
LATE_S = 15.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mode: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(REPO_ROOT),
        )
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(TIMEOUT_S)], env=env, cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    return procs


def _wait_for_fault(proc: subprocess.Popen) -> float:
    """Block until rank 1 prints FAULT (it is about to stop or die); the time it did."""
    line = proc.stdout.readline()
    assert line.strip() == "FAULT", f"rank 1 said {line!r}; stderr: {proc.stderr.read() if proc.poll() else ''}"
    return time.monotonic()


@pytest.mark.parametrize("mode", ["sigstop", "kill"])
def test_frozen_or_dead_peer_is_an_error_naming_the_collective(mode: str) -> None:
    """Rank 1 stops (SIGSTOP) or dies (SIGKILL) after its forward of step 1; rank 0's backward
    collective fails with HangError (a CollectiveError: exit 3) within HANG_TIMEOUT_S + LATE_S
    of the fault; the message names the collective, its ranks, the step and the unit, and the
    diagnosis names rank 1 as stopped or dead."""
    rank0, rank1 = _launch(mode)
    try:
        fault_at = _wait_for_fault(rank1)
        try:
            _, err = rank0.communicate(timeout=PROCESS_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{mode}: rank 0 still blocked {PROCESS_LIMIT_S:g} s after the fault (a hang)")
        ended_at = time.monotonic()
        assert rank0.returncode == 3, f"{mode}: rank 0 exited {rank0.returncode}; stderr:\n{err[-3000:]}"
        # From the later of the fault and rank 0 reaching step 1's backward: on a loaded machine
        # rank 0 may still be in its forward when rank 1 stops, and that time is not a wait.
        backward_at = [float(line.split()[1]) for line in err.splitlines() if line.startswith("BACKWARD_AT")][-1]
        waited = ended_at - max(fault_at, backward_at)
        assert waited < HANG_TIMEOUT_S + LATE_S, f"{mode}: the error came {waited:.1f} s after the fault"
        message = err[err.index("COLLECTIVE_ERROR"):]
        assert message.startswith("COLLECTIVE_ERROR HangError "), message
        assert "over ranks [0, 1] at step 1, unit '" in message, message
        assert any(op in message for op in ("reduce_scatter 'grad'", "all_reduce 'grad'")), message
        assert f"zeroshard.collective_timeout_s={TIMEOUT_S:g}" in message, message
        assert "likely cause: a dead or stopped peer: rank 1 does not answer" in message, message
        if mode == "sigstop":
            assert "rank 1: stopped publishing" in message, message
    finally:
        for proc in (rank0, rank1):
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # a stopped process only goes with SIGKILL
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()


def test_rank0_only_no_grad_forward_at_stage3_is_named_on_both_ranks(dist_pool) -> None:
    """Rank 0 alone runs a no_grad forward at stage 3: its first unit's all-gather waits for
    rank 1, which never joins (it sleeps outside zeroshard). The hang watchdog raises HangError
    on both ranks before the collective timeout, with one diagnosis naming the all-gather and
    the unit (not torch's 30-minute hang, nor gloo's timeout)."""
    timeout_s = 10.0
    case = Case(stage=3, extra={"zeroshard": {
        "collective_timeout_s": timeout_s, "hang_timeout_s": 2, "hang_first_step_timeout_s": 2}})
    rank0, rank1 = dist_pool(2).run(rank0_only_no_grad_forward, case, 60.0, timeout=120)
    assert rank0["type"] == rank1["type"] == "HangError", (rank0, rank1)
    assert "all_gather 'param' over ranks [0, 1] at step 0, unit '" in rank0["message"], rank0
    assert rank0["diagnosis"] == rank1["diagnosis"] and "evaluation forward" in rank0["diagnosis"], rank0
    assert rank0["seconds"] < timeout_s and rank1["seconds"] < timeout_s + 2, (rank0, rank1)


@pytest.mark.parametrize("stage", [0, 2])
def test_rank_one_step_behind_stops_every_rank(dist_pool, stage: int) -> None:
    """Rank 1's forward of step 1 raises and its loop carries on with the next batch (the
    gradients of different batches would be mixed from then on). At the next step every rank
    raises RankDesyncError naming each rank's step and training forwards; no step was taken
    with the mixed gradients (global_steps stays 1)."""
    case = Case(stage=stage, steps=4, extra={"zeroshard": {"collective_timeout_s": 30}})
    outcomes = dist_pool(2).run(rank_falls_behind, case, 1, 1, timeout=120)
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == "RankDesyncError", (rank, outcome)
        message = outcome["message"]
        assert "rank 0 at step 1 after 1 training forward(s)" in message, message
        assert "rank 1 at step 1 after 2 training forward(s)" in message, message
        assert outcome["global_steps"] == 1, (rank, outcome)
