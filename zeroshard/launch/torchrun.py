"""`zeroshard launch`: a thin wrapper over torchrun for user scripts.

    zeroshard launch --nproc 2 train.py --deepspeed_config ds.json

is `python -m torch.distributed.run --standalone --nproc_per_node 2 train.py --deepspeed_config
ds.json`, with the process count defaulting to every GPU (or 2 processes on a CPU-only
machine) and OMP_NUM_THREADS set to the cores per process when the user has not set it.
Multi-machine jobs: call torchrun directly with its rendezvous flags; zeroshard reads its
environment either way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def torchrun_command(nproc: int, script: str, script_args: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc), script, *script_args,
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="zeroshard launch",
        description="Run a training script on this machine with torchrun (one process per GPU, "
        "or 2 on CPU).",
    )
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, or 2 on CPU)")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.script):
        print(f"zeroshard launch: {args.script}: no such file", file=sys.stderr)
        return 2
    nproc = args.nproc if args.nproc is not None else default_nproc()
    if nproc < 1:
        print(f"zeroshard launch: --nproc {nproc}: must be at least 1", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.run(torchrun_command(nproc, args.script, args.script_args), env=env).returncode
