"""The README's runnable example trains, under torchrun with 2 processes, as documented."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_train_minimal_runs_under_torchrun():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_minimal.py"),
        "--deepspeed_config", str(ROOT / "examples" / "configs" / "zero2_fp32.json"), "--steps", "3",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"step\s+(\d+)\s+loss\s+([0-9.]+)\s+grad_norm\s+([0-9.]+)", result.stdout)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], result.stdout
    assert all(float(norm) > 0 for _, _, norm in steps)


def test_train_moe_runs_under_torchrun():
    """docs/moe.md's example: ep_size 2 on 2 processes, ZeRO stage 3."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(ROOT / "examples" / "train_moe.py"),
        "--deepspeed_config", str(ROOT / "examples" / "configs" / "zero3_fp32.json"), "--steps", "3", "--ep-size", "2",
    ]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"step\s+(\d+)\s+loss\s+([0-9.]+)\s+l_aux\s+([0-9.]+)\s+grad_norm\s+([0-9.]+)", result.stdout)
    assert [int(s) for s, _, _, _ in steps] == [1, 2, 3], result.stdout
    # top-2 over 4 experts: the balanced auxiliary loss is 1, near it at initialisation
    assert all(0.5 < float(aux) < 2.0 and float(norm) > 0 for _, _, aux, norm in steps)


def test_autoep_moonlight_tiny_runs_under_zeroshard_launch():
    """docs/moe.md's AutoEP example: AutoEP (autoep_size 2) + Muon + ZeRO-2 on 2 processes; the
    loss falls and the export strict-loads into the unswapped Hugging Face model."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zeroshard", "launch", "--nproc", "2",
           str(ROOT / "examples" / "autoep_moonlight_tiny.py"), "--steps", "8"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    steps = re.findall(r"step\s+(\d+)\s+loss\s+([0-9.]+)", result.stdout)
    assert [int(s) for s, _ in steps] == list(range(1, 9)), result.stdout
    fell = re.search(r"loss fell from ([0-9.]+) to ([0-9.]+); exported weights strict-load", result.stdout)
    assert fell and float(fell.group(2)) < float(fell.group(1)) - 0.1, result.stdout
