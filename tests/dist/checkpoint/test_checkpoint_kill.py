"""A process killed in the middle of a save leaves the previous checkpoint loadable.

The test runs this module as a script (one process per rank, torchrun's environment): it
trains, saves tag "step2", trains one more step, then saves tag "step3" with
ZEROSHARD_CHECKPOINT_CRASH_AT set, so one rank exits abruptly part-way through that save.
The test then kills what is left (as a launcher does when a rank dies), checks that
`latest` still names "step2", and loads it in fresh processes: the next loss equals the one
the killed run computed after "step2", bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.checkpoint.test_checkpoint_helpers import make_engine, train

REPO_ROOT = Path(__file__).resolve().parents[3]
STAGE, MODE = 1, "bf16"
CRASH_ENV = "ZEROSHARD_CHECKPOINT_CRASH_AT"  # zeroshard.checkpoint.save.CRASH_ENV
CRASH_EXIT_CODE = 17  # zeroshard.checkpoint.save.CRASH_EXIT_CODE
SCRIPT_TIMEOUT_S = 180  # imports and process-group set-up on a loaded 2-core machine


def _script(ckpt_dir: str, record: str, crash_at: str) -> None:
    import torch.distributed as dist

    import zeroshard

    zeroshard.init_distributed()
    engine = make_engine(STAGE, MODE, seed=0, dropout=0.1)
    train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir, tag="step2")
    loss_after = train(engine, 2, 3)
    if engine.global_rank == 0:
        Path(record).write_text(json.dumps({"loss_after_step2": loss_after}))
    if dist.is_initialized():
        dist.barrier()  # the record exists before anyone crashes
    os.environ[CRASH_ENV] = crash_at
    engine.save_checkpoint(ckpt_dir, tag="step3")
    raise SystemExit("unreachable: the save should have crashed")


def load_latest_and_train(ckpt_dir: str) -> dict:
    engine = make_engine(STAGE, MODE, seed=1, dropout=0.1)
    path, _ = engine.load_checkpoint(ckpt_dir)
    return {"path": path, "losses": train(engine, 2, 3)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(world_size: int, ckpt_dir: Path, record: Path, crash_at: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", CRASH_ENV)}
        env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        if world_size > 1:
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
        cmd = [sys.executable, "-m", "tests.dist.checkpoint.test_checkpoint_kill", str(ckpt_dir), str(record), crash_at]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize(
    "world_size,crash_at",
    [
        (2, "rank_file@1"),  # rank 1 dies after writing its shard file, before the index exists
        (1, "before_rename@0"),  # the index is written, the directory not yet renamed into place
    ],
)
def test_killed_save_leaves_previous_checkpoint_loadable(dist_pool, tmp_path, world_size: int, crash_at: str) -> None:
    ckpt_dir, record = tmp_path / "ckpt", tmp_path / "record.json"
    procs = _launch(world_size, ckpt_dir, record, crash_at)
    crashing = procs[int(crash_at.split("@")[1])]
    try:
        crashing.wait(timeout=SCRIPT_TIMEOUT_S)
    finally:
        time.sleep(0.2)
        for proc in procs:  # the launcher's part: a rank died, stop the others
            if proc.poll() is None:
                proc.kill()
        outputs = [proc.communicate()[0].decode(errors="replace") for proc in procs]
    assert crashing.returncode == CRASH_EXIT_CODE, f"exit code {crashing.returncode}; output:\n" + "\n".join(outputs)

    assert (ckpt_dir / "latest").read_text().strip() == "step2"
    assert not (ckpt_dir / "step3").exists()
    assert (ckpt_dir / ".step3.tmp").is_dir()  # the half-written save, which nothing reads

    results = dist_pool(world_size).run(load_latest_and_train, str(ckpt_dir), timeout=120)
    expected = json.loads(record.read_text())["loss_after_step2"]
    for result in results:
        assert result["path"] == str(ckpt_dir / "step2")
        assert result["losses"] == expected

    # The next save of the same tag clears the leftover and completes.
    dist_pool(world_size).run(_save_step3_again, str(ckpt_dir), timeout=120)
    assert (ckpt_dir / "latest").read_text().strip() == "step3"
    assert not (ckpt_dir / ".step3.tmp").exists()


def _save_step3_again(ckpt_dir: str) -> None:
    engine = make_engine(STAGE, MODE, seed=1, dropout=0.1)
    engine.load_checkpoint(ckpt_dir)
    train(engine, 2, 3)
    engine.save_checkpoint(ckpt_dir, tag="step3")


if __name__ == "__main__":
    _script(*sys.argv[1:4])
