"""kill -9 of a rank during an asynchronous save leaves the previous checkpoint as `latest`,
loadable bit for bit.

The test runs this module as a script (one process per rank, torchrun's environment): it
trains, saves "step2" asynchronously, trains one more step while that is written (recording
the loss), waits, then saves "step3" asynchronously with the victim's writer held at a point
of the write. Training goes on in every main thread. Once the victim's writer reports that it
is held, the test sends it SIGKILL, then stops the other ranks (as a launcher does), checks
that `latest` still names "step2" and that "step3" was never published, and loads "step2" in
fresh processes: the next loss equals the one recorded, bit for bit.

Also here, as it needs a process of its own: a script that ends while its asynchronous save
is being written exits only once the checkpoint is published.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.checkpoint.test_checkpoint_helpers import make_engine, train
from tests.dist.checkpoint.test_checkpoint_kill import REPO_ROOT, STAGE, _free_port, load_latest_and_train

WORLD = 2
SCRIPT_TIMEOUT_S = 180  # imports and process-group set-up on a loaded 2-core machine


def _script(ckpt_dir: str, record: str, held: str, victim: str) -> None:
    import torch.distributed as dist

    import zeroshard
    from zeroshard.checkpoint import async_save

    point, rank = victim.split("@")
    zeroshard.init_distributed()
    engine = make_engine(STAGE, "bf16", seed=0, dropout=0.1)
    train(engine, 0, 2)
    engine.save_checkpoint(ckpt_dir, tag="step2", async_save=True)
    loss_after = train(engine, 2, 3)  # while step2 is written
    engine.wait_for_checkpoint()
    if engine.global_rank == 0:
        Path(record).write_text(json.dumps({"loss_after_step2": loss_after}))
    dist.barrier()  # the record exists before anyone is killed

    def hold(at: str, at_rank: int) -> None:
        if at == point and at_rank == int(rank):
            Path(held).write_text(str(os.getpid()))
            while True:  # until SIGKILL
                time.sleep(1)

    async_save.WRITER_HOOK = hold
    engine.save_checkpoint(ckpt_dir, tag="step3", async_save=True)
    train(engine, 3, 5)  # training goes on while step3 is (not) written
    engine.wait_for_checkpoint()
    raise SystemExit("unreachable: the victim's writer never finishes")


def _launch(ckpt_dir: Path, record: Path, held: Path, victim: str) -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        env.update(
            PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank),
            WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        cmd = [sys.executable, "-m", "tests.dist.checkpoint.test_checkpoint_async_kill",
               str(ckpt_dir), str(record), str(held), victim]
        procs.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


@pytest.mark.parametrize(
    "victim",
    [
        "rank_file@1",  # rank 1's file is written and fsynced, its done-marker not yet
        "before_rename@0",  # every rank's file and the index are written, not yet renamed into place
    ],
)
def test_kill_during_async_save_keeps_previous_checkpoint(dist_pool, tmp_path, victim: str) -> None:
    ckpt_dir, record, held = tmp_path / "ckpt", tmp_path / "record.json", tmp_path / "held"
    procs = _launch(ckpt_dir, record, held, victim)
    victim_proc = procs[int(victim.split("@")[1])]
    try:
        deadline = time.monotonic() + SCRIPT_TIMEOUT_S
        while not held.exists() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
            time.sleep(0.05)
        assert held.exists(), "the victim's writer was never held"
        assert int(held.read_text()) == victim_proc.pid
        victim_proc.send_signal(signal.SIGKILL)
        victim_proc.wait(timeout=30)
    finally:
        time.sleep(0.2)
        for proc in procs:  # the launcher's part: a rank died, stop the others
            if proc.poll() is None:
                proc.kill()
        outputs = [proc.communicate()[0].decode(errors="replace") for proc in procs]
    assert victim_proc.returncode == -signal.SIGKILL, "\n".join(outputs)

    assert (ckpt_dir / "latest").read_text().strip() == "step2"
    assert not (ckpt_dir / "step3").exists()
    assert (ckpt_dir / ".step3.tmp").is_dir()  # the half-written save, which nothing reads
    if victim.startswith("before_rename"):
        assert (ckpt_dir / ".step3.tmp" / "index.json").is_file()  # killed at the last moment

    results = dist_pool(WORLD).run(load_latest_and_train, str(ckpt_dir), timeout=120)
    expected = json.loads(record.read_text())["loss_after_step2"]
    for result in results:
        assert result["path"] == str(ckpt_dir / "step2")
        assert result["losses"] == expected  # bit for bit


def _exit_script(ckpt_dir: str) -> None:
    """One process: an asynchronous save, then the script ends while the writer is still held."""
    import zeroshard
    from zeroshard.checkpoint import async_save

    zeroshard.init_distributed()
    engine = make_engine(STAGE, "bf16", seed=0)
    train(engine, 0, 1)
    async_save.WRITER_HOOK = lambda point, rank: time.sleep(1.0) if point == "start" else None
    engine.save_checkpoint(ckpt_dir, tag="last", async_save=True)
    print("returned before the files: " + str(not (Path(ckpt_dir) / "last").exists()), flush=True)


def test_interpreter_exit_waits_for_the_writer(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tests.dist.checkpoint.test_checkpoint_async_kill", "exit", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "returned before the files: True" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "latest").read_text().strip() == "last"
    assert (tmp_path / "last" / "index.json").is_file()
    assert not list(tmp_path.glob(".*.tmp"))


if __name__ == "__main__":
    if sys.argv[1] == "exit":
        _exit_script(sys.argv[2])
    else:
        _script(*sys.argv[1:5])
