"""The forward cost of stage 3's direct-use mode (zeroshard/sharding/direct_use.py) on the demo GPT.

    python benchmarks/direct_use_mode.py                          # CPU, --model small, fp32
    python benchmarks/direct_use_mode.py --model tiny --mode bf16 --steps 40
    python benchmarks/direct_use_mode.py --device cuda --model gpt2-124m --mode bf16

One process (world size 1, gloo on CPU, NCCL on CUDA), one stage-3 engine with every unit
sharded (stage3_param_persistence_threshold 0). Forwards with the mode on (as the engine runs)
and with it off (the schedule's mode removed, so no torch function is intercepted) take turns
on the same batch, each followed by its backward, so load that comes and goes hits both alike;
the forward alone is timed, in wall-clock and in process CPU time (on a shared machine the CPU
time is the steadier one). Prints how many torch functions one forward sends through the mode
(those given a watched parameter: none in the demo GPT),
the median forward time of each, and the median of the per-pair ratios on / off. The demo GPT
uses no parameter directly, so this is the price every stage-3 model pays for the mode, not
the cost of a direct use. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.models import build_gpt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", help="demo preset (tiny, small, medium, gpt2-124m, 1b)")
    parser.add_argument("--mode", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="timed pairs (after 3 warm-up pairs)")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = build_gpt(args.model)
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    if args.mode == "bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    schedule = engine._grads.params
    mode_on = schedule._mode
    seq = model.config.block_size
    idx = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=engine.device)
    targets = torch.randint(0, model.config.vocab_size, (args.batch, seq), device=engine.device)

    def timed_forward(with_mode: bool) -> tuple[float, float]:
        """(wall, CPU) seconds of one forward; its backward follows, untimed."""
        schedule._mode = mode_on if with_mode else None
        _sync(device)
        wall, cpu = time.perf_counter(), time.process_time()
        _, loss = engine(idx, targets)
        _sync(device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        engine.backward(loss)
        engine.zero_grad()
        return wall, cpu

    on, off = [], []  # (wall, CPU) per timed forward
    for i in range(args.steps + 3):
        first, second = (True, False) if i % 2 == 0 else (False, True)
        times = {first: timed_forward(first), second: timed_forward(second)}
        if i >= 3:
            on.append(times[True])
            off.append(times[False])
    calls = 0
    find = mode_on._find

    def counting_find(call_args, call_kwargs):
        nonlocal calls
        calls += 1
        return find(call_args, call_kwargs)

    mode_on._find = counting_find
    timed_forward(True)
    mode_on._find = find
    schedule._mode = mode_on
    print(f"model={args.model} mode={args.mode} device={args.device} batch={args.batch} pairs={args.steps}")
    print(f"torch functions the mode sees per forward: {calls}")
    for k, clock in enumerate(("wall", "CPU")):
        a, b = [t[k] for t in on], [t[k] for t in off]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        extra = statistics.median(x - y for x, y in zip(a, b, strict=True))
        print(
            f"{clock:4s} forward: with the mode {statistics.median(a) * 1e3:.2f} ms, without "
            f"{statistics.median(b) * 1e3:.2f} ms (medians); per-pair ratio {ratio:.3f} (median), "
            f"{extra * 1e6:.1f} us more per forward"
            + (f", {extra / calls * 1e6:.2f} us per torch function" if calls else "")
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
