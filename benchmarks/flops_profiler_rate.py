"""The flops profiler's achieved rate against the bare matmul rate, on a matmul-only model.

    python benchmarks/flops_profiler_rate.py              # CPU, one thread, 9 repeats
    python benchmarks/flops_profiler_rate.py --device cuda

One process, one engine per repeat with `flops_profiler` on: an N x N weight times a
(32 N) x N input, so the step's two matmuls (forward, weight gradient) dwarf everything else.
The bare rate of those two matmuls is measured right before and right after the profiler's
timed step, and each repeat's ratio is to their mean (load that comes and goes between
measurements moves the ratio less). Prints the median ratio and writes
benchmarks/results/flops_profiler_rate.json. Measured on a 2-core CPU machine, one thread:
median 0.88 (the step also copies the gradient and runs SGD); a miscount or mistiming would be a
factor of 2 or more.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import zeroshard

RESULTS = Path(__file__).resolve().parent / "results"


def bare_rate_tflops(batch: int, n: int, device: torch.device) -> float:
    x, g, w = (torch.randn(batch, n, device=device), torch.randn(batch, n, device=device),
               torch.randn(n, n, device=device))
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        torch.mm(x, w.t())
        torch.mm(g.t(), x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 4 * batch * n * n / best / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    n, batch = args.n, 32 * args.n
    x, grad = torch.randn(batch, n, device=device), torch.randn(batch, n, device=device)
    ratios = []
    for _ in range(args.repeats):
        model = nn.Linear(n, n, bias=False)
        config = {"train_micro_batch_size_per_gpu": batch, "steps_per_print": 100, "zeroshard": {"peak_tflops": 1.0},
                  "optimizer": {"type": "SGD", "params": {"lr": 1e-6}},
                  "flops_profiler": {"enabled": True, "profile_step": 1}}
        engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=args.device == "cuda")
        for _ in range(2):  # step 0, and step 1 (profile_step): counted
            engine.backward(engine(x), scale_wrt_gas=False, gradient=grad)
            engine.step()
        before = bare_rate_tflops(batch, n, device)
        engine.backward(engine(x), scale_wrt_gas=False, gradient=grad)  # step 2: timed
        engine.step()
        after = bare_rate_tflops(batch, n, device)
        ratios.append(engine.figures.summary()["flops/achieved_tflops"] / ((before + after) / 2))
    median = statistics.median(ratios)
    print(f"achieved / bare matmul rate, N={n}, {args.device}, {args.threads} thread(s): median {median:.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} repeats)")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "flops_profiler_rate.json"
    path.write_text(json.dumps({"n": n, "device": args.device, "ratios": ratios, "median": median}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
