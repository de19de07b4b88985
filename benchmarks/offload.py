"""ZeRO-Offload on CPU: the engine's step time with and without offload, and the host
optimizer step with torch's fused CPU AdamW against the foreach one.

    python benchmarks/offload.py --world-size 2 --model small --steps 8 --repeat 3 --params 20000000

Part 1 trains a demo GPT under torchrun (gloo, CPU, OMP_NUM_THREADS=1 per rank) at stages 1-3,
bf16, without offload and with `offload_optimizer` (stage 3: and `offload_param`), and reports
the median time of a whole training step (forward, backward, step) after two warm-up steps;
with `--repeat N` the whole grid runs N times round-robin and the table shows the median run
(on a shared machine, load moves single runs by 2x).
On a CPU-only machine the "host" is the device, so this measures offload's extra copies and
its CPU optimizer kernel, not a device-memory saving; on a GPU the saving would be measured
against `explain` (no GPU was available for these figures).

Part 2 times `optimizer.step()` of AdamW over `--params` fp32 elements (one flat master, as a
rank holds it) with `fused=True` (what offload uses, zeroshard.optim.cpu_adam.DeepSpeedCPUAdam) and
`foreach=True`, in this process with the machine's threads.

Prints both tables and writes benchmarks/results/offload.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import build_gpt

    zeroshard.init_distributed()
    torch.manual_seed(0)
    model = build_gpt(args.model)
    zero: dict = {"stage": args.stage, "stage3_param_persistence_threshold": 0}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if args.stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)
    block = model.config.block_size
    gen = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for step in range(args.steps + 2):
        x = torch.randint(0, 256, (2, block), generator=gen)
        dist.barrier()
        start = time.perf_counter()
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - start)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, statistics.median(times))
    if dist.get_rank() == 0:
        out = {
            "stage": args.stage, "offload": args.offload, "world_size": dist.get_world_size(),
            "model": args.model, "num_params": sum(p.numel() for p in model.parameters()),
            "step_s_median_per_rank": gathered, "optimizer": type(engine.optimizer).__name__,
        }
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def optimizer_step_times(numel: int, repeats: int) -> dict[str, float]:
    import torch

    out = {}
    for kind in ("fused", "foreach"):
        master = torch.zeros(numel, requires_grad=True)
        master.grad = torch.randn(numel)
        opt = torch.optim.AdamW([master], lr=1e-4, **{kind: True})
        opt.step()  # state allocated outside the timing
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            samples.append(time.perf_counter() - start)
        out[kind] = statistics.median(samples)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--params", type=int, default=20_000_000, help="elements for the optimizer-step timing")
    parser.add_argument("--repeats", type=int, default=10, help="timed optimizer steps")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the engine grid, round-robin")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    RESULTS.mkdir(exist_ok=True)
    rows = []
    for stage, offload in [(s, o) for _ in range(args.repeat) for s in (1, 2, 3) for o in (False, True)]:
        out = RESULTS / f"_offload_{stage}_{int(offload)}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.world_size), __file__, "--worker", "--stage", str(stage), "--model", args.model,
               "--steps", str(args.steps), "--out", str(out)] + (["--offload"] if offload else [])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows.append(json.loads(out.read_text()))
        out.unlink()
    print(f"engine step, demo GPT {args.model} ({rows[0]['num_params']:,} params), bf16, world {args.world_size}, CPU")
    print(f"{'stage':>5}  {'no offload (ms)':>16}  {'offload (ms)':>13}  {'ratio':>6}")
    runs: dict[tuple[int, bool], list[float]] = {}
    for r in rows:
        runs.setdefault((r["stage"], r["offload"]), []).append(max(r["step_s_median_per_rank"]))
    by = {key: statistics.median(times) for key, times in runs.items()}
    for stage in (1, 2, 3):
        none, off = by[(stage, False)], by[(stage, True)]
        print(f"{stage:>5}  {none * 1e3:>16.1f}  {off * 1e3:>13.1f}  {off / none:>6.2f}")
    import torch

    opt = optimizer_step_times(args.params, args.repeats)
    print(f"\nAdamW step on {args.params:,} fp32 elements, {torch.get_num_threads()} thread(s)")
    print(f"  fused   {opt['fused'] * 1e3:8.1f} ms")
    print(f"  foreach {opt['foreach'] * 1e3:8.1f} ms   (fused is {opt['foreach'] / opt['fused']:.1f}x faster)")
    path = RESULTS / "offload.json"
    path.write_text(json.dumps({"engine": rows, "optimizer_step": {"numel": args.params, **opt,
                                                                  "threads": torch.get_num_threads()}}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
