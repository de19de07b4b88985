"""docs/muon.md's QK-clip example runs under `zeroshard launch` on 2 processes (MLA, AutoEP,
ZeRO-2): the first step's logits are far over the threshold, and once clipped they stay
within 40% of it (each step's new batch and Muon update can push them over again; the
clip brings them back)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TAU = 20.0


def test_muon_qk_clip_example_keeps_logits_near_the_threshold():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zeroshard", "launch", "--nproc", "2", str(ROOT / "examples" / "muon_qk_clip.py"),
           "--steps", "3"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"step (\d+) loss ([0-9.]+) s_max ([0-9.]+) clipped_heads (\d+)/8", result.stdout)
    assert [int(s[0]) for s in steps] == [1, 2, 3], result.stdout
    s_max = [float(s[2]) for s in steps]
    assert s_max[0] > 1.3 * TAU and int(steps[0][3]) >= 4, result.stdout
    assert all(s < 1.4 * TAU for s in s_max[1:]), result.stdout
