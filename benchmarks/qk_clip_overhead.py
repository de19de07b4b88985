"""What MuonClip (QK-clip) costs a step: Muon with `qk_clip` on against Muon alone, on the demo
GPT (its attention runs F.scaled_dot_product_attention), plus the S_max capture on its own
against one SDPA forward of the same shape.

    python benchmarks/qk_clip_overhead.py                      # W=1, demo "small", 60 steps
    python benchmarks/qk_clip_overhead.py --world-size 2 --model tiny --json out.json

Both engines are built in the same processes and take turns, one optimizer step each on the
same batch (the order alternating), so load that comes and goes on a shared machine hits both
alike. Each step starts after a barrier and is timed on rank 0; the first 10 are warm-up.
QK-clip adds, per attention call, one chunked Q.K^T product for the maximum (forward only, no
backward), and per step one MAX all-reduce of n_layer x n_head floats and an elementwise
rescale of the query/key rows of the masters. Prints a table of medians, writes JSON. A
benchmark, not a test: nothing asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

TAU = 100.0


def _engine(model_name: str, qk_clip: bool):
    import zeroshard
    from zeroshard.models import build_gpt

    torch.manual_seed(0)
    params = {"muon_lr": 0.02, "adam_lr": 3e-3}
    if qk_clip:
        params["qk_clip"] = {"enabled": True, "threshold": TAU, "alpha": 0.5}
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "steps_per_print": 1000,
              "optimizer": {"type": "Muon", "params": params}, "zero_optimization": {"stage": 2}}
    engine, *_ = zeroshard.initialize(model=build_gpt(model_name), config=config)
    return engine


def _capture_cost(batch: int, heads: int, seq: int, dim: int, repeats: int) -> dict[str, float]:
    """Median ms of one SDPA forward and of max_logits on the same q, k (causal)."""
    from zeroshard.optim.muon.qk_clip import max_logits

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(batch, heads, seq, dim, device=device) for _ in range(3))
    sdpa, capture = [], []

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(repeats):
        sdpa.append(timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        capture.append(timed(lambda: max_logits(q, k, dim**-0.5, is_causal=True)))
    return {"shape": [batch, heads, seq, dim], "sdpa_forward_ms": 1e3 * statistics.median(sdpa),
            "max_logits_ms": 1e3 * statistics.median(capture)}


def _worker(rank: int, world: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    engines = {"muon": _engine(args.model, False), "muon+qk_clip": _engine(args.model, True)}
    block = engines["muon"].module.config.block_size
    gen = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (16, block + 1), generator=gen).to(engines["muon"].device)
        order = list(engines.items()) if step % 2 == 0 else list(engines.items())[::-1]
        for name, engine in order:
            dist.barrier()
            start = time.perf_counter()
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            if step >= 10:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        config = engines["muon"].module.config
        base, clip = statistics.median(times["muon"]), statistics.median(times["muon+qk_clip"])
        capture = _capture_cost(16, config.n_head, block, config.n_embd // config.n_head, 20)
        result = {
            "model": args.model, "world_size": world, "timed_steps": len(times["muon"]),
            "device": engines["muon"].device.type,
            "torch_threads": torch.get_num_threads(),
            "median_step_ms": {"muon": 1e3 * base, "muon+qk_clip": 1e3 * clip},
            "overhead_percent": 100 * (clip / base - 1), "capture_one_attention_call": capture,
            "s_max_last_step": float(engines["muon+qk_clip"].qk_clip.last_max.max()),
        }
        print(f"demo {args.model}, {world} rank(s), {result['timed_steps']} timed steps, ZeRO-2, SDPA attention")
        print("| engine        | median step (ms) |\n|---------------|------------------|")
        print(f"| Muon          | {1e3 * base:16.2f} |\n| Muon+QK-clip  | {1e3 * clip:16.2f} |")
        print(f"QK-clip overhead: {result['overhead_percent']:+.2f}%")
        print(f"one attention call {capture['shape']}: SDPA forward {capture['sdpa_forward_ms']:.3f} ms, "
              f"max_logits {capture['max_logits_ms']:.3f} ms")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--json", default="qk_clip_overhead.json")
    args = parser.parse_args()
    port = 29500 + os.getpid() % 1000
    mp.spawn(_worker, args=(args.world_size, args, port), nprocs=args.world_size)


if __name__ == "__main__":
    main()
