"""MoE with expert parallelism: tokens/s and all-to-all bytes per step at several ep_size.

    python benchmarks/moe.py                          # world 4, ep_size 1, 2, 4, gloo on CPU
    python benchmarks/moe.py --world-size 2 --ep-sizes 1,2 --steps 20 --json out.json

Every rank trains the demo GPT ("tiny" shape) whose MLPs are `zeroshard.moe.layer.MoE` layers
(--experts experts, top --k, capacity factor 1, tokens dropped past capacity) under ZeRO
stage --stage, on random bytes. Per ep_size it reports the median step time as tokens/s over
the world, and the all-to-all traffic `zeroshard.comm.recording()` saw in one step against
the theory:

    per MoE layer and micro-step: 4 all-to-alls (dispatch, combine, and their gradients),
    each of E x C x M elements per rank (E experts, C = ceil(S / E x capacity_factor x k)
    slots, S tokens on the rank, M the hidden size), of which (ep - 1) / ep leave the rank.

DeepSpeed's MoE is not installed in this environment (no `deepspeed` package), so there is
no side-by-side column; the peers benchmarks (benchmarks/peers.py) explain why. A benchmark,
not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def theory_bytes(args: argparse.Namespace, ep: int) -> tuple[int, int]:
    """(elements per rank in one step's all-to-alls, of which off the rank), fp32 bytes."""
    if ep == 1:
        return 0, 0
    tokens = args.micro * args.seq
    capacity = max(math.ceil(tokens / args.experts * 1.0 * args.k), 4)
    per_call = args.experts * capacity * args.hidden
    total = 4 * args.layers * per_call * 4  # 4 collectives, fp32
    return total, total * (ep - 1) // ep


def _rank_main(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size)
    import zeroshard
    from zeroshard.models import build_gpt

    rows = []
    for ep in (int(e) for e in args.ep_sizes.split(",")):
        torch.manual_seed(0)
        model = build_gpt(
            "tiny", n_layer=args.layers, n_embd=args.hidden, block_size=args.seq,
            moe_num_experts=args.experts, moe_ep_size=ep, moe_k=args.k,
        )
        config = {
            "train_micro_batch_size_per_gpu": args.micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.stage},
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = zeroshard.initialize(model=model, config=config)
        g = torch.Generator().manual_seed(rank)
        times, a2a = [], []
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, 256, (args.micro, args.seq), generator=g)
            dist.barrier()
            start = time.perf_counter()
            with zeroshard.comm.recording() as log:
                _, loss = engine(x, x)
                engine.backward(loss)
                engine.step()
            elapsed = torch.tensor(time.perf_counter() - start)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= args.warmup:
                times.append(elapsed.item())
                a2a.append(log.total_bytes(op="all_to_all"))
        median = statistics.median(times)
        total, off_rank = theory_bytes(args, ep)
        rows.append({
            "ep_size": ep,
            "step_s": median,
            "tokens_per_s": args.world_size * args.micro * args.seq / median,
            "all_to_all_bytes": max(a2a),
            "theory_bytes": total,
            "theory_off_rank_bytes": off_rank,
        })
        del engine, model
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    from benchmarks.process_group import close_group

    close_group()  # after every engine is gone (benchmarks/process_group.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ep-sizes", default="1,2,4")
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/moe.json")
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    mp.spawn(_rank_main, args=(args, port, str(out)), nprocs=args.world_size, join=True)
    rows = json.loads(out.read_text())
    print(f"world {args.world_size}, {args.layers} MoE layers x {args.experts} experts, top-{args.k}, "
          f"hidden {args.hidden}, {args.micro}x{args.seq} tokens per rank, stage {args.stage}, gloo on CPU")
    print("| ep_size | tokens/s | all-to-all bytes/step/rank (recorded) | theory (off the rank) |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['ep_size']} | {r['tokens_per_s']:,.0f} | {r['all_to_all_bytes']:,} | "
              f"{r['theory_bytes']:,} ({r['theory_off_rank_bytes']:,}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
