"""DeepSpeed's stage-3 memory caps on the demo GPT: what `stage3_max_live_parameters` and
`stage3_max_reuse_distance` do to memory, gathers and step time.

    python benchmarks/stage3_caps.py                      # CPU, --model small, fp32
    python benchmarks/stage3_caps.py --device cuda --model gpt2-124m --mode bf16

One process per setting (world size 1: gloo on CPU, NCCL on CUDA; every unit sharded,
stage3_param_persistence_threshold 0), so each one's memory high-water is its own. Settings:
zeroshard's default (prefetch bucket 5e7 elements, reuse distance 0), a live cap of two
transformer blocks, DeepSpeed's default reuse distance (1e9: units stay gathered from their
forward to their backward), and the two together. Per setting: the most parameter elements the
stage-3 schedule held gathered at once (exact, from the schedule), the process's peak memory
(CUDA: max_memory_allocated; CPU: ru_maxrss, which includes everything the process ever held),
flat buffers gathered per step, and the median step time. Prints a table and writes
benchmarks/results/stage3_caps.json. A benchmark, not a test (tests/dist/sharding/test_stage3_caps.py
checks the bounds exactly).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def settings(block_numel: int) -> dict[str, dict]:
    return {
        "default": {},
        "live cap 2 blocks": {"stage3_max_live_parameters": 2 * block_numel},
        "reuse 1e9": {"stage3_max_reuse_distance": 1_000_000_000},
        "reuse 1e9 + cap": {"stage3_max_reuse_distance": 1_000_000_000, "stage3_max_live_parameters": 2 * block_numel},
    }


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import build_gpt
    from zeroshard.sharding.flat import FlatParamGroup

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29540 + args.index))
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = build_gpt(args.model)
    params = sum(p.numel() for p in model.parameters())
    block_numel = sum(p.numel() for p in model.blocks[0].parameters())
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **settings(block_numel)[args.setting]}
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    if args.mode == "bf16":
        config["bf16"] = {"enabled": True}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    schedule = engine._grads.params
    schedule.track_peak = True
    seq = model.config.block_size
    idx = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=engine.device)
    targets = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=engine.device)
    # Count materialisations (at world 1 a gather is a local copy, not a recorded collective).
    started = {"n": 0}
    real_start = FlatParamGroup.start_gather

    def counted_start(flat, *a, **k):
        started["n"] += 0 if flat.full_held else 1
        return real_start(flat, *a, **k)

    FlatParamGroup.start_gather = counted_start
    times, gathers = [], []
    for step in range(args.steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, started["n"] = time.perf_counter(), 0
        _, loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= 2:  # the first steps have no trace yet (nothing is prefetched or kept)
            times.append(time.perf_counter() - start)
            gathers.append(started["n"])
    element = 2 if args.mode == "bf16" else 4
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out = {
        "setting": args.setting, "model": args.model, "mode": args.mode, "device": args.device,
        "params": params, "block_numel": block_numel,
        "peak_gathered_bytes": schedule.peak_held_numel * element, "peak_process_bytes": peak,
        "gathers_per_step": statistics.median(gathers), "step_s_median": statistics.median(times),
    }
    Path(args.out).write_text(json.dumps(out))
    # The group is this script's: freed here, its gloo threads do not live into interpreter
    # shutdown ([Note: process-group lifetime] in zeroshard/launch/distributed.py).
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="demo preset (tiny, small, medium, gpt2-124m, 1b)")
    parser.add_argument("--mode", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per setting (after 2 untimed)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for index, setting in enumerate(settings(0)):
        out = RESULTS / f"_stage3_caps_{index}.json"
        command = [sys.executable, __file__, "--worker", "--setting", setting, "--index", str(index),
                   "--out", str(out), "--model", args.model, "--mode", args.mode, "--device", args.device,
                   "--batch", str(args.batch), "--steps", str(args.steps)]
        subprocess.run(command, check=True)
        rows.append(json.loads(out.read_text()))
        out.unlink()
    print(f"{args.model} ({rows[0]['params'] / 1e6:.1f}M parameters, block {rows[0]['block_numel'] / 1e6:.2f}M), "
          f"{args.mode}, {args.device}, world 1")
    print(f"{'setting':<20} {'peak gathered MiB':>18} {'peak process MiB':>17} {'gathers/step':>13} {'step s':>8}")
    for row in rows:
        gathered, process = row["peak_gathered_bytes"] / 2**20, row["peak_process_bytes"] / 2**20
        print(f"{row['setting']:<20} {gathered:>18.1f} {process:>17.1f} "
              f"{row['gathers_per_step']:>13.0f} {row['step_s_median']:>8.3f}")
    path = RESULTS / "stage3_caps.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
