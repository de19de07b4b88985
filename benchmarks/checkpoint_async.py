"""Time training is blocked per checkpoint save, synchronous against asynchronous
(`"checkpoint": {"writer": {"decoupled": true}}`), for the demo's GPT presets.

    python benchmarks/checkpoint_async.py                                   # small and medium, CPU
    python benchmarks/checkpoint_async.py --models small --saves 3 --json out.json

One process, the demo's embedded config (ZeRO stage 2, AdamW, fp32 on the CPU). For each
model preset the same engine saves `--saves` times synchronously, then `--saves` times
asynchronously, one training step before each save. Reported, medians over the saves:

- blocked: what the training loop waits for per save. Synchronous: the `save_checkpoint` call.
  Asynchronous: the call (the host copy and the collectives) plus whatever the next wait still
  had to wait for the writer; here training steps run until the writer has published, so that
  remainder is the last step's overlap only, and the wait is timed separately (`wait`).
- write: asynchronous only, from the call's return until the writer published the checkpoint
  (the files are written, fsynced, renamed, `latest` moved) while training ran.
- step: the median training step time without a save in flight, and while the writer runs
  (the writer competes for the CPU and, in Python, for the GIL). The steps use `--seq` tokens
  (32): the checkpoint is the model's whatever the sequence, and short steps keep the run short.
- in brackets: the CPU time of the training thread during the blocked call, which load from
  other processes on a shared machine barely moves (wall times there do move).

The save directory is a fresh temporary directory (`--dir` to choose the file system). A
benchmark, not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zeroshard from the checkout

import zeroshard  # noqa: E402
from zeroshard.checkpoint import async_save  # noqa: E402
from zeroshard.demo.train import default_config  # noqa: E402
from zeroshard.models import GPT, PRESETS  # noqa: E402


def build(preset: str, micro: int):
    torch.manual_seed(0)
    model = GPT(PRESETS[preset])
    config = default_config(total_steps=10_000, on_gpu=False)
    config["train_micro_batch_size_per_gpu"] = micro
    config["steps_per_print"] = 10**9
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model.config.block_size


def step(engine, seq: int, micro: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (micro, seq + 1), generator=g)
    start = time.perf_counter()
    _, loss = engine(x[:, :-1], x[:, 1:])
    engine.backward(loss)
    engine.step()
    return time.perf_counter() - start


def checkpoint_bytes(tag_dir: Path) -> int:
    return sum(p.stat().st_size for p in tag_dir.iterdir() if p.is_file())


def measure(preset: str, saves: int, micro: int, seq: int, root: Path) -> dict:
    engine, block = build(preset, micro)
    block = min(block, seq)  # short sequences: the checkpoint is the same, the steps cheaper
    params = sum(p.numel() for p in engine.module.parameters())
    save_dir = root / preset
    for i in range(2):  # warm-up: first steps and first save pay one-off costs
        step(engine, block, micro, i)
    engine.save_checkpoint(save_dir, tag="warmup", async_save=False)
    seed = 100

    plain_steps, sync_blocked, sync_cpu = [], [], []
    for i in range(saves):
        plain_steps.append(step(engine, block, micro, seed := seed + 1))
        start, cpu = time.perf_counter(), time.thread_time()
        engine.save_checkpoint(save_dir, tag=f"sync{i}", async_save=False)
        sync_blocked.append(time.perf_counter() - start)
        sync_cpu.append(time.thread_time() - cpu)
    size = checkpoint_bytes(save_dir / "sync0")

    published = threading.Event()
    done_at: list[float] = []

    def hook(point: str, _rank: int) -> None:
        if point == "published":
            done_at.append(time.perf_counter())
            published.set()

    async_save.WRITER_HOOK = hook
    call, call_cpu, wait, write, busy_steps = [], [], [], [], []
    try:
        for i in range(saves):
            step(engine, block, micro, seed := seed + 1)
            published.clear()
            start, cpu = time.perf_counter(), time.thread_time()
            engine.save_checkpoint(save_dir, tag=f"async{i}", async_save=True)
            returned = time.perf_counter()
            call.append(returned - start)
            call_cpu.append(time.thread_time() - cpu)
            while not published.is_set():  # training goes on while the files are written
                busy_steps.append(step(engine, block, micro, seed := seed + 1))
            start = time.perf_counter()
            engine.wait_for_checkpoint()
            wait.append(time.perf_counter() - start)
            write.append(done_at[-1] - returned)
    finally:
        async_save.WRITER_HOOK = None
    engine.destroy()

    def ms(values: list[float]) -> float | None:
        return round(1e3 * statistics.median(values), 2) if values else None

    return {
        "model": preset,
        "params": params,
        "checkpoint_mb": round(size / 2**20, 2),
        "saves": saves,
        "sync_blocked_ms": ms(sync_blocked),
        "sync_thread_cpu_ms": ms(sync_cpu),
        "async_call_thread_cpu_ms": ms(call_cpu),
        "async_call_ms": ms(call),
        "async_wait_ms": ms(wait),
        "async_blocked_ms": ms([c + w for c, w in zip(call, wait, strict=True)]),
        "async_write_ms": ms(write),
        "step_ms": ms(plain_steps),
        "step_while_writing_ms": ms(busy_steps),
        "steps_while_writing": len(busy_steps),
        "raw_s": {"sync_blocked": sync_blocked, "async_call": call, "async_wait": wait, "async_write": write,
                  "sync_thread_cpu": sync_cpu, "async_call_thread_cpu": call_cpu},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,medium", help="demo presets, comma-separated")
    parser.add_argument("--saves", type=int, default=5, help="saves per mode (medians over them)")
    parser.add_argument("--micro", type=int, default=1, help="micro-batch size of the training steps")
    parser.add_argument("--seq", type=int, default=32, help="sequence length of the training steps")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--json", default="benchmarks/results/checkpoint_async.json", help="results file")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (1: on a shared machine, waiting on descheduled helper threads "
                        "dominates every timing)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for preset in args.models.split(","):
            rows.append(measure(preset, args.saves, args.micro, args.seq, Path(root)))

    print(f"blocked per save, median of {args.saves}; ms (training thread CPU ms)")
    header = (f"{'model':<7} {'params':>9} {'ckpt MB':>8} {'sync blocked':>20} {'async blocked':>21} "
              f"{'(call+wait)':>14} {'async write':>12} {'step':>8} {'step|writing':>13}")
    print(header)
    for r in rows:
        print(f"{r['model']:<7} {r['params']:>9} {r['checkpoint_mb']:>8} "
              f"{r['sync_blocked_ms']:>9} ({r['sync_thread_cpu_ms']:>6}) "
              f"{r['async_blocked_ms']:>10} ({r['async_call_thread_cpu_ms']:>6}) "
              f"{r['async_call_ms']:>7}+{r['async_wait_ms']:<6} "
              f"{r['async_write_ms']:>12} {r['step_ms']:>8} {r['step_while_writing_ms']!s:>13}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "micro": args.micro, "seq": args.seq,
            "load_average": os.getloadavg()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
