"""The longest sequence a tiny Llama trains at a fixed per-rank memory budget, with sequence
parallelism 1, 2 and 4 (CPU, gloo), and the tokens/s of each.

    python benchmarks/sequence_parallel.py --budget-mib 400 --sizes 1 2 4

For each SP size the script launches SP ranks (torchrun), builds the same Llama from a config,
registers Ulysses attention (ALST) and trains one step (ZeRO-3, AdamW) at doubling sequence
lengths. A rank's peak memory is its process's peak resident set (ru_maxrss) minus what it held
before the first step, so it counts activations, gradients and optimizer state; the longest
length whose peak stays within the budget on every rank is reported, with tokens/s of that
step, and the activation part of the peak against `explain`'s prediction (1/P of SP 1's).

Then Ulysses attention alone, zeroshard against DeepSpeed in the same run (see
benchmarks/sequence_attention.py): forward + backward tokens/s of `DistributedAttention` on
this Llama's attention shapes at world sizes 2 and 4, DeepSpeed's under the interpreter of
`--deepspeed-python` (a separate virtualenv; without the flag only zeroshard's column):

    python benchmarks/sequence_parallel.py --deepspeed-python /path/to/dsvenv/bin/python

Writes everything to `--json` (default benchmarks/results/sequence_parallel.json).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from sequence_attention import compare, print_table

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def worker(lengths: list[int], budget_mib: float) -> None:
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
    from zeroshard.sequence.loss import token_weighted_loss

    zeroshard.init_distributed()
    sp = dist.get_world_size()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                         intermediate_size=344, vocab_size=512, max_position_embeddings=max(lengths),
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1) if sp > 1 else None
    ds_config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6}
    engine, *_ = zeroshard.initialize(model=model, config=ds_config, mpu=mpu)
    group = engine.seq_parallel_group or dist.group.WORLD
    rank = dist.get_rank()
    baseline = _rss_mib()
    results = []
    for length in lengths:
        local = length // sp
        ids = torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        mine = slice(rank * local, (rank + 1) * local) if sp > 1 else slice(0, length)
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:]
        start = time.perf_counter()
        logits = engine(input_ids=ids[:, mine], position_ids=torch.arange(length)[None, mine]).logits
        loss_sum = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels[:, mine].flatten(),
                                                     reduction="sum")
        engine.backward(token_weighted_loss(loss_sum, (labels[:, mine] != -100).sum(), group))
        engine.step()
        elapsed = time.perf_counter() - start
        peak = torch.tensor([_rss_mib() - baseline])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results.append({"length": length, "peak_mib": round(peak.item(), 1), "tokens_per_s": round(length / elapsed)})
        if peak.item() > budget_mib:
            break
    if rank == 0:
        print("RESULT " + json.dumps({"sp": sp, "steps": results}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mib", type=float, default=400)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--deepspeed-python", help="interpreter with DeepSpeed installed: adds its column")
    parser.add_argument("--attention-worlds", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--attention-lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--attention-iters", type=int, default=10)
    parser.add_argument("--attention-repeat", type=int, default=2)
    parser.add_argument("--skip-memory", action="store_true", help="only the attention comparison")
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sequence_parallel.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.lengths, args.budget_mib)
        return
    rows = [] if args.skip_memory else memory_sweep(args)
    attention = None
    if args.attention_worlds:
        attention = compare(args.attention_worlds, args.attention_lengths, args.attention_iters, 2,
                            args.attention_repeat, args.deepspeed_python, sys.executable)
        print_table(attention)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "budget_mib": args.budget_mib,
                               "load_avg_1min": os.getloadavg()[0], "memory": rows, "attention": attention},
                              indent=1))
    print(f"wrote {out}")


def memory_sweep(args: argparse.Namespace) -> list[dict]:
    rows = []
    for sp in args.sizes:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp),
               __file__, "--worker", "--budget-mib", str(args.budget_mib), "--lengths", *map(str, args.lengths)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    base = {s["length"]: s["peak_mib"] for s in rows[0]["steps"]} if rows and rows[0]["sp"] == 1 else {}
    print(f"budget {args.budget_mib:.0f} MiB per rank (peak RSS growth over the first step's start)")
    print("sp  longest-fitting-length  peak_mib  tokens/s   peak / SP1's at their longest common length (explain)")
    for row in rows:
        fits = [s for s in row["steps"] if s["peak_mib"] <= args.budget_mib]
        best = fits[-1] if fits else None
        common = [s for s in row["steps"] if base.get(s["length"], 0) > 0]
        ratio = ""
        if common:
            c = common[-1]
            ratio = f"{c['peak_mib'] / base[c['length']]:.2f} at {c['length']} (explain {1 / row['sp']:.2f})"
        if best:
            print(f"{row['sp']:<3} {best['length']:<23} {best['peak_mib']:<9} {best['tokens_per_s']:<10} {ratio}")
        else:
            print(f"{row['sp']:<3} none fits")
        print(f"    all steps: {row['steps']}")
    return rows


if __name__ == "__main__":
    main()
