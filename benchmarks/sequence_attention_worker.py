"""One rank of benchmarks/sequence_parallel.py's attention comparison (launched by torchrun).

Times forward + backward of Ulysses `DistributedAttention` around causal SDPA on the
benchmark Llama's attention shapes (hidden 128, 4 heads of 32, batch 1, [batch, seq, heads,
dim]) at each sequence length, over gloo. `--engine zeroshard` uses
`zeroshard.sequence.layer.DistributedAttention`, `--engine deepspeed` DeepSpeed's
`deepspeed.sequence.layer.DistributedAttention`; this file imports nothing else of either, so
it runs under the interpreter that has the engine (DeepSpeed lives in its own virtualenv).

An iteration's time is the slowest rank's (max over ranks); rank 0 prints one `RESULT {json}`
line with every iteration's time per length (and the local attention's alone, see below), and
the sum of |output| over ranks (the inputs come from seeds, so both engines must print the
same sum).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HEADS, HEAD_DIM = 4, 32


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["zeroshard", "deepspeed"], required=True)
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    if args.engine == "deepspeed":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="gloo")
        version = deepspeed.__version__
    else:
        from zeroshard.sequence.layer import DistributedAttention

        dist.init_process_group("gloo")
        version = "local"
    world, rank = dist.get_world_size(), dist.get_rank()
    attn = DistributedAttention(_causal_sdpa, dist.group.WORLD, scatter_idx=2, gather_idx=1)
    results = []
    for length in args.lengths:
        gen = torch.Generator().manual_seed(length * 10 + rank)
        shape = (1, length // world, HEADS, HEAD_DIM)
        q, k, v = (torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(3))
        grad = torch.randn(shape, generator=gen)
        with torch.no_grad():  # the same inputs on both engines: their outputs must agree
            checksum = attn(q, k, v, 0).double().abs().sum().reshape(1)
        dist.all_reduce(checksum)
        # The local attention alone on what each rank attends over (the whole sequence, its
        # heads), timed in the same process between the engine's iterations: the engine's time
        # minus this is what its all-to-alls cost, which launch-to-launch noise on a shared
        # machine does not blur.
        heads = HEADS // world + (rank < HEADS % world)
        full = (1, length, heads, HEAD_DIM)
        lq, lk, lv = (torch.randn(full, generator=gen).requires_grad_(True) for _ in range(3))
        lgrad = torch.randn(full, generator=gen)
        times, local_times = [], []
        for i in range(args.warmup + args.iters):
            for distributed, into in ((True, times), (False, local_times)):
                dist.barrier()
                start = time.perf_counter()
                if distributed:
                    attn(q, k, v, 0).backward(grad)
                else:
                    _causal_sdpa(lq, lk, lv).backward(lgrad)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    into.append(elapsed.item())
        results.append({"length": length, "times_s": times, "local_attention_times_s": local_times,
                        "output_abs_sum": checksum.item()})
    if rank == 0:
        print("RESULT " + json.dumps({"engine": args.engine, "version": version, "world": world,
                                      "torch": torch.__version__, "threads": torch.get_num_threads(),
                                      "lengths": results}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
