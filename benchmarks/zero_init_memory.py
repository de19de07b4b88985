"""Peak host memory of building a model with and without `zeroshard.zero.Init` (stage 3).

    python benchmarks/zero_init_memory.py [--world-size 2] [--blocks 8] [--dim 1024]

For each variant, `world-size` fresh processes (gloo, CPU) import torch, create the process
group, then build the same model (`blocks` x [Linear(dim, 4 dim), Linear(4 dim, dim)] plus an
embedding, fp32): plainly, or inside `zeroshard.zero.Init` with a stage-3 config. A thread
samples the process's resident set size (/proc/self/statm) every millisecond while the model is
built; the table shows, per rank, the peak RSS above the RSS just before building and the RSS
still held after it (the model itself, or this rank's parts). The model's full fp32 size is
printed beside them. Writes benchmarks/results/zero_init_memory.json.

RSS counts what the allocator holds. glibc's default raises its mmap threshold after large
blocks are freed and then keeps such blocks in its heap, so one process's RSS would show freed
parameters as held; the workers therefore run with MALLOC_MMAP_THRESHOLD_=65536 (unless set),
which returns every large freed block to the system, in both variants alike. A fresh process
per variant keeps one variant's freed memory out of the other's.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from host_memory import PeakSampler, rss, spawn_ranks

RESULTS = Path(__file__).resolve().parent / "results"

def build_model(blocks: int, dim: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(dim, 4 * dim)
            self.down = nn.Linear(4 * dim, dim)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(1024, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = block(h)
            return h

    torch.manual_seed(0)
    return Model()


def worker(rank: int, world: int, port: int, variant: str, blocks: int, dim: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    import zeroshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    dist.barrier()
    before = rss()[0]
    sampler = PeakSampler().start()
    if variant == "init":
        with zeroshard.zero.Init(config_dict_or_path=config):
            model = build_model(blocks, dim)
    else:
        model = build_model(blocks, dim)
    peak = sampler.stop()
    after = rss()[0]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    queue.put({"variant": variant, "rank": rank, "peak_delta": peak - before, "held_delta": after - before,
               "model_bytes": numel * 4, "numel": numel})
    dist.barrier()
    dist.destroy_process_group()


def run_variant(variant: str, world: int, blocks: int, dim: int) -> list[dict]:
    return spawn_ranks(worker, world, (variant, blocks, dim), variant, timeout_s=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # inherited by the workers (docstring)
    rows = run_variant("plain", args.world_size, args.blocks, args.dim)
    rows += run_variant("init", args.world_size, args.blocks, args.dim)
    mib = 2**20
    model_mib = rows[0]["model_bytes"] / mib
    print(f"model: {rows[0]['numel']:,} parameters, {model_mib:.1f} MiB in fp32; world size {args.world_size}")
    print(f"{'variant':<8} {'rank':>4} {'peak above start (MiB)':>23} {'held after (MiB)':>17}")
    for row in rows:
        print(f"{row['variant']:<8} {row['rank']:>4} {row['peak_delta'] / mib:>23.1f} {row['held_delta'] / mib:>17.1f}")
    peak = {v: max(r["peak_delta"] for r in rows if r["variant"] == v) for v in ("plain", "init")}
    held = {v: max(r["held_delta"] for r in rows if r["variant"] == v) for v in ("plain", "init")}
    ratio = peak["init"] / peak["plain"]
    print(f"peak ratio init / plain: {ratio:.3f}; held ratio: {held['init'] / held['plain']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "zero_init_memory.json"
    out.write_text(json.dumps({"world_size": args.world_size, "blocks": args.blocks, "dim": args.dim,
                               "rows": rows, "peak_ratio": ratio,
                               "held_ratio": held["init"] / held["plain"]}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
