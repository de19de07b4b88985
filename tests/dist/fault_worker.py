"""One rank of a 2-rank run in which rank 1 fails in the middle of step 1 (tests/dist/comm/test_fault_injection.py).

    python tests/dist/fault_worker.py MODE TIMEOUT_S     (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

MODE "sigstop": rank 1 stops itself (SIGSTOP) after its forward of step 1, holding its
connections open, as a frozen process does. MODE "kill": rank 1 kills itself (SIGKILL) there.
Rank 0 goes on into the backward's collectives; it prints "COLLECTIVE_ERROR <type> <message>"
to stderr and exits 3 when it gets zeroshard's CollectiveError (the hang watchdog's HangError is
one), 0 if it finishes, 1 on any other error. It runs with zeroshard.collective_timeout_s = TIMEOUT_S.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zeroshard  # noqa: E402
from tests.dist.reference import build_model, global_batches, micro_batch  # noqa: E402
from zeroshard.comm.faults import CollectiveError  # noqa: E402


def main() -> int:
    mode, timeout_s = sys.argv[1], float(sys.argv[2])
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "zeroshard": {"collective_timeout_s": timeout_s},
    }
    engine, _, _, _ = zeroshard.initialize(model=build_model(0), config=config)
    rank = engine.global_rank
    for step, batch in enumerate(global_batches(0, 3, 4)):
        tokens, targets = micro_batch(batch, rank, 0, 2, 2)
        loss = engine(tokens, targets)
        if rank == 1 and step == 1:
            print("FAULT", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if mode == "sigstop" else signal.SIGKILL)
            time.sleep(3600)  # not reached after SIGKILL; a stopped process is killed by the test
        # CLOCK_MONOTONIC is one clock for every process of the machine: the test measures
        # the wait from when this rank reached the failing collectives, not from the fault,
        # so a loaded machine's slow forward does not count against the timeout.
        print(f"BACKWARD_AT {time.monotonic():.6f}", file=sys.stderr, flush=True)
        try:
            engine.backward(loss)
            engine.step()
        except CollectiveError as exc:
            print(f"COLLECTIVE_ERROR {type(exc).__name__} {exc}", file=sys.stderr, flush=True)
            os._exit(3)  # the group is broken: leave without tearing it down
    return 0


if __name__ == "__main__":
    sys.exit(main())
