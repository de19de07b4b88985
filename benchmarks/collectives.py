"""Collective costs on this machine's backend: the measurements behind two engine choices.

    python benchmarks/collectives.py                        # W=2, gloo on CPU (NCCL on GPUs)
    python benchmarks/collectives.py --world-size 4 --sizes 200000,2400000 --json out.json

1. Reduce-scatter against all-reduce of the same buffer (and all-gather of it): on gloo the
   all-reduce was faster, so `zeroshard.comm.collectives.reduce_scatter` runs as an all-reduce there.
2. One collective over a whole buffer against the same buffer cut into `--pieces` collectives
   (issued asynchronously, then waited for): the per-collective fixed cost that made
   zeroshard fill its gradient buckets across units (zeroshard/grads/reduce.py).

Each cell is the median of --repeats timed calls after --warmup, each call starting after a
barrier and counted as its slowest rank's time. Prints a table and writes JSON
(default benchmarks/results/collectives.json). A benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from zeroshard.comm import compat as _compat

DEFAULT_SIZES = "50000,200000,800000,1240000,2400000,10000000"
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_reduce_pieces")


def _call(op: str, full: torch.Tensor, shard: torch.Tensor, pieces: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(full)
    elif op == "reduce_scatter":
        _compat.reduce_scatter_single(shard, full)
    elif op == "all_gather":
        _compat.all_gather_single(full, shard)
    else:
        works = [dist.all_reduce(chunk, async_op=True) for chunk in full.chunk(pieces)]
        for work in works:
            work.wait()


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        numel = size // args.world_size * args.world_size
        full = torch.randn(numel, device=device)
        shard = torch.empty(numel // args.world_size, device=device)
        cell = {"numel": numel, "mib": numel * 4 / 2**20}
        for op in OPS:
            samples = []
            for i in range(args.warmup + args.repeats):
                dist.barrier()
                if use_cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                _call(op, full, shard, args.pieces)
                if use_cuda:
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], device=device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    samples.append(elapsed.item() * 1e3)
            cell[op + "_ms"] = statistics.median(samples)
        rows.append(cell)
    if rank == 0:
        meta = {
            "backend": backend, "world_size": args.world_size, "pieces": args.pieces,
            "repeats": args.repeats, "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average": os.getloadavg(),
        }
        Path(out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()


def _print_table(result: dict) -> None:
    meta = result["meta"]
    print(f"{meta['backend']}, W={meta['world_size']}, median of {meta['repeats']} calls (ms); "
          f"pieces = the buffer as {meta['pieces']} async all-reduces")
    header = f"{'elements':>10} {'MiB':>6} {'all_reduce':>11} {'reduce_scat':>11} {'all_gather':>11} " \
             f"{'pieces':>8} {'RS / AR':>8} {'pieces / AR':>11}"
    print(header)
    for r in result["rows"]:
        ar = r["all_reduce_ms"]
        print(f"{r['numel']:>10} {r['mib']:>6.2f} {ar:>11.2f} {r['reduce_scatter_ms']:>11.2f} "
              f"{r['all_gather_ms']:>11.2f} {r['all_reduce_pieces_ms']:>8.2f} "
              f"{r['reduce_scatter_ms'] / ar:>8.2f} {r['all_reduce_pieces_ms'] / ar:>11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of fp32 element counts")
    parser.add_argument("--pieces", type=int, default=7, help="collectives the split buffer is cut into")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "collectives.json"))
    args = parser.parse_args()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(args, args.port, args.json), nprocs=args.world_size, start_method="spawn")
    result = json.loads(Path(args.json).read_text())
    _print_table(result)
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
