"""`zeroshard demo`: start the demo's training script under torchrun and wait for it.

Two processes on CPU (gloo), or one per GPU when CUDA is available. The script itself is
zeroshard/demo/train.py; this module only picks the process count and the environment.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from zeroshard.demo.train import DEFAULT_MODEL, DEFAULT_STEPS, RunDirMismatch, add_moe_arguments, check_run_dir
from zeroshard.models import PRESETS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zeroshard demo",
        description=(
            "Train a small byte-level GPT on this interpreter's own standard-library source with "
            "ZeRO stage 2. Run it again with the same --run-dir to resume from the last checkpoint."
        ),
    )
    parser.add_argument("--config", help="DeepSpeed-style JSON config (default: an embedded one)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        choices=list(PRESETS),
        help=f"model size (default {DEFAULT_MODEL}); tiny, small and medium train on CPUs, the larger ones need GPUs",
    )
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: 2 on CPU, one per GPU with CUDA)")
    parser.add_argument("--run-dir", default="runs/demo", help="where results go (default runs/demo)")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--sample-tokens", type=int, default=200, help="bytes to generate at the end")
    parser.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps")
    parser.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint every N steps")
    add_moe_arguments(parser)
    return parser


def default_nproc() -> int:
    """One process per GPU when CUDA is available, else 2 CPU processes."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2


def child_env(nproc: int, on_gpu: bool) -> dict[str, str]:
    """The environment for torchrun: our package importable, and CPU threads shared out."""
    env = dict(os.environ)
    # The child must import this same zeroshard even when it is not installed (a source checkout).
    package_parent = str(Path(__file__).resolve().parents[2])  # the folder holding the zeroshard package
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    if not on_gpu and "OMP_NUM_THREADS" not in env:
        # Without this each process would start one thread per core and they would fight.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // nproc))
    return env


def torchrun_command(args: argparse.Namespace, nproc: int, run_dir: Path) -> list[str]:
    """`python -m torch.distributed.run ... -m zeroshard.demo.train FLAGS`."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
        "-m", "zeroshard.demo.train",
        "--steps", str(args.steps),
        "--model", args.model,
        "--run-dir", str(run_dir),
        "--seed", str(args.seed),
        "--sample-tokens", str(args.sample_tokens),
        "--eval-every", str(args.eval_every),
        "--checkpoint-every", str(args.checkpoint_every),
    ]  # fmt: skip
    if args.config:
        command += ["--config", str(Path(args.config).resolve())]
    if args.moe_experts:
        command += ["--moe-experts", str(args.moe_experts), "--moe-ep-size", str(args.moe_ep_size)]
        command += ["--moe-k", str(args.moe_k)]
    return command


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the training processes' exit code."""
    args = build_parser().parse_args(argv)
    if args.config and not Path(args.config).is_file():
        print(f"zeroshard demo: --config {args.config}: no such file.", file=sys.stderr)
        return 2
    on_gpu = torch.cuda.is_available()
    nproc = args.nproc or default_nproc()
    if nproc < 1:
        print(f"zeroshard demo: --nproc={nproc}: must be at least 1.", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    try:
        check_run_dir(run_dir, args.model)
    except RunDirMismatch as error:
        print(f"zeroshard demo: {error}", file=sys.stderr)
        return 2
    print(f"zeroshard demo: {nproc} processes on {'GPU' if on_gpu else 'CPU'}; run dir {run_dir}", flush=True)
    # The children inherit our stdout/stderr: their output streams straight through, and rank 0
    # sees the terminal, so it can draw a live progress bar.
    result = subprocess.run(torchrun_command(args, nproc, run_dir), env=child_env(nproc, on_gpu))
    if result.returncode == 0:
        print(f"zeroshard demo: done; results in {run_dir}", flush=True)
    else:
        print(f"zeroshard demo: training failed (exit code {result.returncode}); see above.", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main())
