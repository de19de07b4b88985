"""Host memory of saving, consolidating and loading a checkpoint, against the cap issue 39 sets.

    python benchmarks/checkpoint_host_memory.py [--preset gpt2-124m] [--world-size 2]

W ranks (gloo, CPU) train one step of a demo GPT at stage 3 (bf16, AdamW), then each measures
its own host peak above what training holds, with the process's anonymous resident memory
sampled every millisecond (benchmarks/host_memory.py's PeakSampler) and the CPU allocator's
count (zeroshard.memory.AllocationTracker), while it runs `save_checkpoint`, `save_16bit_model`
(rank 0 writes) and `load_checkpoint`. The cap per rank is issue 39's: the rank's share of the
states plus the largest unit plus 10%. Then `write_fp32` (`zeroshard to-fp32`) consolidates the
checkpoint in a fresh process, measured the same way against a cap of a quarter of the model's
fp32 size, beside what it did before (the whole dict from `consolidate_fp32`, written by
safetensors' `save_file`) in another.
(An enforced cap does not work here: safetensors maps the files copy-on-write, which RLIMIT_DATA
and RLIMIT_AS count whole; anonymous memory is what the mapping's readers do not share.)
Writes benchmarks/results/checkpoint_host_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MIB = 2**20


def _measured(fn) -> dict:
    """Run fn() twice: the most anonymous resident bytes above the start, then (a second run,
    since the profiler's own records take resident memory) the allocator's peak."""
    from benchmarks.host_memory import PeakSampler, rss
    from zeroshard.memory import AllocationTracker

    gc.collect()
    start = rss()[1]
    sampler = PeakSampler().start()
    fn()
    gc.collect()
    sampler.stop()
    with AllocationTracker() as tracker:
        fn()
        gc.collect()
    return {"rss_anon_bytes": sampler.peak_anon - start, "allocated_bytes": tracker.peak_bytes}


def _worker(rank: int, world: int, port: int, preset: str, ckpt: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.models import build_gpt

    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zeroshard.memory import enable_cpu_memory_reporting

    enable_cpu_memory_reporting()  # before the engine: a state the load replaces counts as freed
    torch.manual_seed(0)
    model = build_gpt(preset)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    engine, *_ = zeroshard.initialize(model=model, config=config)
    del model
    x = torch.randint(0, 256, (1, 32))
    loss = engine(x, x)[1]
    engine.backward(loss)
    engine.step()
    del loss
    share = sum(f.master.numel() * f.master.element_size() for f in engine.flats)
    share += sum(v.numel() * v.element_size() for s in engine.optimizer.state.values() for v in s.values()
                 if isinstance(v, torch.Tensor) and v.dim() > 0)
    largest_unit = max(sum(f.padded_numel * f.full.element_size() for f in u.flats) for u in engine.units)
    cap = int(1.1 * (share + largest_unit))
    row = {"rank": rank, "share_bytes": share, "largest_unit_bytes": largest_unit, "cap_bytes": cap,
           "params": sum(f.numel for f in engine.flats)}
    row["save"] = _measured(lambda: engine.save_checkpoint(ckpt, tag="t"))
    row["save_16bit"] = _measured(lambda: engine.save_16bit_model(ckpt, "model16.safetensors"))
    row["load"] = _measured(lambda: engine.load_checkpoint(ckpt, tag="t"))
    queue.put(row)
    engine.destroy()
    dist.destroy_process_group()


CONSOLIDATE = r"""
import sys, time
from benchmarks.host_memory import PeakSampler, rss
mode, ckpt, out = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
from pathlib import Path
from zeroshard.checkpoint import consolidate_fp32, write_fp32
from zeroshard.checkpoint.export import _write_state_dict
from zeroshard.memory import AllocationTracker


def run():
    if mode == "streamed":
        write_fp32(ckpt, out, tag="t")
    else:  # what write_fp32 did before it streamed: the whole dict, then safetensors' save_file
        _write_state_dict(consolidate_fp32(ckpt, tag="t"), Path(out), {"format": "pt"})


run()  # once first: imports, caches and the allocator's own arenas are not the consolidation's
start_total, start = rss()
sampler = PeakSampler().start()
t = time.perf_counter()
run()
sampler.stop()
seconds = time.perf_counter() - t
with AllocationTracker() as tracker:  # apart: the profiler's own records take resident memory
    run()
print(sampler.peak_anon - start, tracker.peak_bytes, round(seconds, 2), sampler.peak - start_total)
"""


def _consolidate(mode: str, ckpt: str, out: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CONSOLIDATE, mode, ckpt, out], cwd=REPO,
                            capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    if result.returncode != 0:
        raise RuntimeError(f"to-fp32 {mode} failed: {result.stderr[-1500:]}")
    anon, allocated, seconds, total = result.stdout.strip().splitlines()[-1].split()
    return {"rss_anon_bytes": int(anon), "rss_bytes": int(total), "allocated_bytes": int(allocated),
            "seconds": float(seconds)}


def main() -> int:
    sys.path.insert(0, str(REPO))
    from benchmarks.host_memory import spawn_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        rows = spawn_ranks(_worker, args.world_size, (args.preset, ckpt), "checkpoint_host_memory", 1800)
        params = rows[0]["params"]
        fp32_bytes = 4 * params
        cap = fp32_bytes // 4
        consolidate = {mode: _consolidate(mode, ckpt, os.path.join(tmp, f"{mode}.safetensors"))
                       for mode in ("streamed", "whole")}
    print(f"{args.preset}: {params:,} parameters, fp32 copy {fp32_bytes / MIB:.1f} MiB; W={args.world_size}, stage 3, "
          "bf16, AdamW (MiB above what training holds; cap = share + largest unit + 10%)")
    print(f"{'rank':>4} {'operation':<12} {'RSS anon':>9} {'allocated':>10} {'cap':>8}  within")
    within = True
    for row in rows:
        for op in ("save", "save_16bit", "load"):
            m = row[op]
            ok = max(m["rss_anon_bytes"], m["allocated_bytes"]) <= row["cap_bytes"]
            within &= ok
            print(f"{row['rank']:>4} {op:<12} {m['rss_anon_bytes'] / MIB:>9.1f} {m['allocated_bytes'] / MIB:>10.1f} "
                  f"{row['cap_bytes'] / MIB:>8.1f}  {ok}")
    for mode, c in consolidate.items():
        ok = c["rss_anon_bytes"] <= cap  # the allocator sees no safetensors read: anonymous memory
        print(f"to-fp32 {mode:<9} RSS anon {c['rss_anon_bytes'] / MIB:7.1f}  RSS with mapped files "
              f"{c['rss_bytes'] / MIB:7.1f}  cap {cap / MIB:.1f} (a quarter of the fp32 copy)  within {ok}  "
              f"({c['seconds']} s)")
        if mode == "streamed":
            within &= ok
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "checkpoint_host_memory.json"
    out.write_text(json.dumps({"preset": args.preset, "world_size": args.world_size, "params": params,
                               "fp32_bytes": fp32_bytes, "consolidate_cap_bytes": cap, "ranks": rows,
                               "consolidate": consolidate, "seconds": round(time.perf_counter() - started, 1)},
                              indent=1))
    print(f"wrote {out}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
