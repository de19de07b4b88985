"""What the engine's figures cost a step: wall_clock_breakdown, flops_profiler and
comms_logger on (and the MoE/Muon figures, which are on by default where they apply) against
all off, on the demo GPT at steps_per_print 10.

    python benchmarks/figures_overhead.py                  # W=2 gloo ranks, demo "small", 60 steps
    python benchmarks/figures_overhead.py --model tiny --steps 40 --world-size 1

Both engines are built in the same processes and take turns, one optimizer step each on the
same batch, so load that comes and goes on a shared machine hits both alike (as
benchmarks/interleaved.py does). Each step starts after a barrier and is timed on rank 0.
The first 10 steps are warm-up and the flops profiler's counted step is left out. Prints the
median step time of each and their ratio. A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

FIGURES_ON = {
    "wall_clock_breakdown": True,
    "flops_profiler": {"enabled": True, "profile_step": 5},
    "comms_logger": {"enabled": True},
}


def _engine(model_name: str, extra: dict):
    import zeroshard
    from zeroshard.demo.train import default_config
    from zeroshard.models import build_gpt

    torch.manual_seed(0)
    config = {**default_config(total_steps=1000, on_gpu=False), **extra}
    engine, *_ = zeroshard.initialize(model=build_gpt(model_name), config=config)
    return engine


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    engines = {"off": _engine(args.model, {}), "on": _engine(args.model, FIGURES_ON)}
    block = engines["off"].module.config.block_size
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (16, block + 1), generator=gen)
        order = list(engines.items()) if step % 2 == 0 else list(engines.items())[::-1]  # neither always first
        for name, engine in order:
            dist.barrier()
            start = time.perf_counter()
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            dist.barrier()
            if step >= 10 and step not in (5, 6):
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        off, on = statistics.median(times["off"]), statistics.median(times["on"])
        print(f"demo {args.model}, {world} rank(s), {len(times['on'])} timed steps, steps_per_print 10")
        print(f"figures off: median step {off * 1e3:.2f} ms")
        print(f"figures on:  median step {on * 1e3:.2f} ms")
        print(f"cost: {100 * (on / off - 1):+.2f}%")
        print("last figures:", {k: round(v, 3) for k, v in engines["on"].figures.summary().items()
                                if not k.startswith("comms/")})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_worker, args=(args.world_size, args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
