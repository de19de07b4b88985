"""docs/sequence-parallel.md's example trains a Hugging Face Llama under sequence parallelism
2 with torchrun, as documented (a short sequence and two steps, to keep CI quick)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_train_long_sequence_sp_runs_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_long_sequence_sp.py"), "--seq-length", "512", "--steps", "2",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"step (\d+) loss ([0-9.]+) seq 512 sp 2", result.stdout)
    assert [int(s) for s, _ in steps] == [1, 2], result.stdout
    # Random tokens over a 1024-word vocabulary: the loss starts near ln(1024) = 6.93.
    assert all(5.0 < float(loss) < 9.0 for _, loss in steps), steps
