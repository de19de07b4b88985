"""DeepSpeed's launch line runs unchanged: `deepspeed --num_gpus 2 SCRIPT --deepspeed_config CFG`
with the `deepspeed` command that `zeroshard install-deepspeed-alias --target DIR` installs.

The line is docs/launching.md's own (examples/deepspeed_command.py); each rank's losses must be
those of a single-process fp32 run on the whole batch (data-parallel SGD averages the two
ranks' gradients, which is the gradient of the whole batch's mean loss, the slices being equal).
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import time
from pathlib import Path

import torch
from torch import nn

from zeroshard.tools.deepspeed_alias import install

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = "examples/deepspeed_command.py"
DOC_LINE = f"deepspeed --num_gpus 2 {EXAMPLE} --deepspeed --deepspeed_config examples/configs/zero2_sgd_fp32.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reference_losses(steps: int = 2, world: int = 2, micro: int = 4, dim: int = 8, lr: float = 0.1):
    """Per rank, the loss of its slice under one fp32 model trained on the whole batch by SGD."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(steps * world * micro, dim, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = {r: [] for r in range(world)}
    for step in range(steps):
        with torch.no_grad():
            for r in range(world):
                rows = slice((step * world + r) * micro, (step * world + r + 1) * micro)
                losses[r].append(nn.functional.mse_loss(model(x[rows]), y[rows]).item())
        batch = slice(step * world * micro, (step + 1) * world * micro)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
        optimizer.step()
    return losses


def test_the_docs_deepspeed_line_trains_two_ranks_like_one_fp32_process(tmp_path):
    doc = (ROOT / "docs" / "launching.md").read_text(encoding="utf-8")
    assert f"$ {DOC_LINE}\n" in doc, "docs/launching.md no longer shows the line this test runs"
    target, out = tmp_path / "alias", tmp_path / "out"
    out.mkdir()
    install(target)  # `zeroshard install-deepspeed-alias --target DIR` (its CLI: tests/unit/tools)
    words = shlex.split(DOC_LINE)
    command = [str(target / "bin" / "deepspeed"), "--master_port", str(_free_port()), *words[1:], "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]), OMP_NUM_THREADS="1")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("rank*.json"))}
    assert set(ranks) == {0, 1}
    assert [ranks[r]["local_rank"] for r in (0, 1)] == [0, 1]  # DeepSpeed's --local_rank=<n>
    assert {r["world_size"] for r in ranks.values()} == {2}
    expected = _reference_losses()
    for r in (0, 1):
        # fp32 on both sides; the 2-rank gradient is an all-reduce of the two slices' sums, a
        # different summation order than one backward over the batch: ~1e-7 relative.
        torch.testing.assert_close(torch.tensor(ranks[r]["losses"]), torch.tensor(expected[r]),
                                   rtol=1e-5, atol=1e-6)


FAIL_SCRIPT = """
import os, signal, sys, time
out = sys.argv[-1]
if os.environ["RANK"] == "0":
    def stopped(signum, frame):
        open(os.path.join(out, "rank0_signal"), "w").write(str(signum))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stopped)
    open(os.path.join(out, "rank0_parent"), "w").write(str(os.getppid()))
    time.sleep(60)
else:
    while not os.path.exists(os.path.join(out, "rank0_parent")):
        time.sleep(0.05)
    sys.exit(3)
"""


def test_a_failing_rank_ends_the_others_and_the_command_fails(tmp_path):
    """Rank 1 exits 3 once rank 0 is up; rank 0 would sleep a minute. The `deepspeed` process is
    torchrun itself (the ranks' parent), so a signal sent to it reaches torchrun, and torchrun
    ends rank 0 with SIGTERM (what zeroshard's preemption handler receives) and exits non-zero."""
    target = tmp_path / "alias"
    install(target)
    script = tmp_path / "fail.py"
    script.write_text(FAIL_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]), OMP_NUM_THREADS="1")
    command = [str(target / "bin" / "deepspeed"), "-q", "--master_port", str(_free_port()), "--num_gpus", "2",
               "--no_local_rank", str(script), str(tmp_path)]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "exitcode  : 3" in stderr, stderr[-3000:]  # torchrun's report names rank 1's status
    assert time.monotonic() - start < 45  # rank 0 did not sleep its minute out
    assert int((tmp_path / "rank0_parent").read_text()) == process.pid
    assert (tmp_path / "rank0_signal").read_text() == str(int(signal.SIGTERM))
