"""The documented examples train under torchrun with 2 processes, as README.md and docs/ say."""

import contextlib
import importlib.util
import io
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

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


def test_muon_per_head_runs_under_zeroshard_launch():
    """docs/muon.md's example: a custom model's head attributes give per-head Muon at ZeRO-3 on 2
    processes (q/k/v rows, o columns, GQA), the Conv1d is one matrix, and the loss falls."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "zeroshard", "launch", "--nproc", "2",
           str(ROOT / "examples" / "muon_per_head.py"), "--steps", "8"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for line in ("attn.k.weight      Muon  per-head: 2 row blocks 8x32",
                 "attn.o.weight      Muon  per-head: 4 column blocks 32x8",
                 "mix.weight         Muon  3-D, viewed as 32x96"):
        assert line in result.stdout, result.stdout
    losses = [float(v) for _, v in re.findall(r"step\s+(\d+)\s+loss\s+([0-9.]+)", result.stdout)]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, result.stdout


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


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example_script(name: str) -> str:
    """Rank-side: run examples/NAME as its __main__ in a pooled worker (torchrun's environment and
    a gloo group are already there, as under torchrun) and return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    return out.getvalue()


def test_quickstart_on_two_ranks_is_data_parallelism_over_the_global_batch(dist_pool):
    """README.md's example on 2 processes: rank 0's losses are those of one process training on
    both ranks' micro-batches together (ZeRO-2 changes nothing in the maths). On the pooled
    workers rather than a torchrun of its own: the same environment, without 20 s of start-up."""
    printed = dist_pool(2).run(run_example_script, "quickstart.py", timeout=120)[0]
    got = [float(v) for v in re.findall(r"step \d+ loss ([0-9.]+)", printed)]
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    data = TensorDataset(x, x @ torch.randn(8, 1))
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loaders = [DataLoader(data, batch_size=16, sampler=DistributedSampler(data, 2, r, shuffle=True, seed=0))
               for r in (0, 1)]
    want = []
    for (x0, y0), (x1, y1) in zip(*loaders, strict=True):
        losses = [nn.functional.mse_loss(model(xb), yb) for xb, yb in ((x0, y0), (x1, y1))]
        opt.zero_grad()
        (sum(losses) / 2).backward()  # the engine averages the ranks' gradients
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        want.append(losses[0].item())
    assert len(got) == len(want) == 16, printed
    # 1e-5 relative: the print rounds to 1e-6 on losses above 0.5, and the two-rank sum and the
    # AdamW kernels differ in operation order (~1e-7 relative per step).
    assert got == pytest.approx(want, rel=1e-5)


def test_full_tensors_at_stage_3_on_two_ranks(dist_pool):
    """docs/training.md's example on 2 processes at stage 3: the full gradient is plain PyTorch's
    (both ranks hold the same batch, so the average is that batch's gradient), and the log shows
    the unit gathers and the gradient reduce-scatters."""
    out = dist_pool(2).run(run_example_script, "full_tensors.py", timeout=120)[0]
    grad_sum, grad_norm = (float(v) for v in re.search(r"full grad \(8, 8\) sum (\S+) norm (\S+)", out).groups())
    example = _load_example("full_tensors")
    torch.manual_seed(0)
    model = example.Model()
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    model(x, y).backward()
    g = model.blocks[0].fc.weight.grad
    # 2e-6 absolute: the print rounds to 1e-6; averaging two equal fp32 gradients is exact.
    assert grad_sum == pytest.approx(g.sum().item(), abs=2e-6)
    assert grad_norm == pytest.approx(g.norm().item(), abs=2e-6)
    ops = set(re.findall(r"^collective (\w+) torch.float32", out, re.M))
    assert {"all_gather", "reduce_scatter"} <= ops, out
    assert "after GatheredParameters: |master| = 0.0" in out
