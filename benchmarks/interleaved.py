"""DDP and zeroshard's stages in the same processes, step for step: low-noise ratios.

    python benchmarks/interleaved.py                           # W=2, fp32, ddp,s0,s1,s2,s3
    python benchmarks/interleaved.py --world-size 4 --mode bf16 --steps 20
    python benchmarks/interleaved.py --config-extra '{"zero_optimization": {"reduce_bucket_size": 200000}}'
    python benchmarks/interleaved.py --engines s0,s0-det,s1,s1-det,s2,s2-det,s3,s3-det   # the mode's cost
    python benchmarks/interleaved.py --device cuda --mode bf16   # NCCL, one GPU per rank
    python benchmarks/interleaved.py --engines s2-bare,s2,s3-bare,s3   # the hang watchdog's cost
    git worktree add /tmp/before <commit>                      # before/after a change:
    python benchmarks/interleaved.py --zeroshard-root /tmp/before --json before.json

`peers.py` runs each engine in its own processes, one after another, so load that comes and
goes between runs moves their ratios. Here every engine is built in the same W processes and
they take turns, one step each, on the same batch: whatever else the machine does hits all
of them alike, so the ratio of each one's median step time to DDP's is stable to a few
percent even on a busy 2-core machine. Use it to measure the effect of one engine change
(`--zeroshard-root` imports zeroshard from another checkout); use `peers.py` for the full
table with memory, communication and the other peers.

The workload is peers.py's (benchmarks/peers_workload.py): the demo GPT at --model, the same
synthetic text and batches, AdamW, clipping at 1.0. Each step starts after a barrier and
counts as its slowest rank's time; forward / backward / step phases are rank 0's, and so is
the CPU time column (process CPU per step: on a shared machine the steadier number). Prints a
table and writes JSON. A benchmark, not a test: nothing asserts.

With `--device cuda` the ranks use cuda:rank and NCCL, batches are on the GPU, each step is
timed between two `torch.cuda.synchronize()` calls (phases by CUDA events), and the table adds
each engine's GPU memory: the peak during its step above what was allocated before it (every
engine's states live in the same processes, so absolute peaks are peers.py's to measure).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent


def _ddp_runner(workload, mode: str, device: torch.device):
    from peers_device import PhaseClock, autocast
    from peers_workload import ADAMW_KWARGS, GRADIENT_CLIPPING, build_model
    from torch.nn.parallel import DistributedDataParallel

    if mode == "fp16":
        raise ValueError("--mode fp16: DDP has no fp16 recipe here (no masters, no loss scale); "
                         "drop ddp from --engines, e.g. --engines s0,s1,s2,s3")
    model = build_model(workload)
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    on_cuda = device.type == "cuda"
    ddp = DistributedDataParallel(model, device_ids=[device.index] if on_cuda else None, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_KWARGS, **({"fused": True} if on_cuda else {}))

    def step(x, y):
        clock = PhaseClock(device)
        clock.mark()
        with autocast(device, mode == "autocast"):
            _, loss = ddp(x, y)
        clock.mark()
        loss.backward()
        clock.mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRADIENT_CLIPPING)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
        return clock.seconds()

    return step


def _merge(config: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            _merge(config[key], value)
        else:
            config[key] = value
    return config


def _zeroshard_runner(workload, mode: str, name: str, extra: dict, device: torch.device):
    from peers_engines import _engine_config, deepspeed_style_step
    from peers_workload import build_model

    import zeroshard

    stage, _, variant = name[1:].partition("-")
    model = build_model(workload)
    config = _merge(_engine_config(workload, mode, int(stage)), extra)
    if variant == "det":  # the deterministic reduction (docs/deterministic-reduction.md)
        config = _merge(config, {"zeroshard": {"deterministic_reduction": True}})
    engine, _, _, _ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    if variant == "nodirectuse":
        # Stage 3 without its direct-use mode (zeroshard/sharding/direct_use.py): the floor its
        # cost is measured against. Only for models that use no parameter outside its unit.
        engine._grads.params._mode = None
    elif variant == "det":
        pass  # the config above
    elif variant == "bare":
        # Its collectives neither recorded for the hang watchdog nor put on their phase's
        # channel, waited for plainly (zeroshard/comm/progress.py's `bypassed`): the floor the
        # watchdog's cost is measured against (the watchdog thread itself runs for both).
        from zeroshard.comm import progress

        def bare(x, y):
            with progress.bypassed():
                return deepspeed_style_step(engine, x, y, device=device)[1]

        return bare
    elif variant:
        raise ValueError(f"--engines {name}: unknown variant {variant!r} (known: nodirectuse, det, bare)")
    return lambda x, y: deepspeed_style_step(engine, x, y, device=device)[1]


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    for path in (str(HERE), args.zeroshard_root):  # zeroshard from --zeroshard-root first
        sys.path.insert(0, path)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    os.environ["LOCAL_RANK"] = str(rank)  # one machine: zeroshard picks cuda:rank from it
    from peers_device import init_group
    from process_group import close_group

    device = init_group(args.device, rank, args.world_size, f"tcp://127.0.0.1:{port}")
    # The engines and DDP live only inside _measure: gone before the group is destroyed.
    result = _measure(rank, args, device)
    if rank == 0:
        Path(args.json).write_text(json.dumps(result, indent=1))
    close_group()


def _measure(rank: int, args: argparse.Namespace, device: torch.device) -> dict | None:
    """Build every engine, take turns step by step; rank 0 returns the table (others None)."""
    from peers_device import synchronize
    from peers_workload import BatchPlan, Workload

    on_cuda = device.type == "cuda"
    workload = Workload(args.model, args.world_size, args.global_batch, args.steps, args.warmup)
    plan = BatchPlan(workload)
    names = args.engines.split(",")
    extra = json.loads(args.config_extra)
    runners = {
        n: _ddp_runner(workload, args.mode, device) if n == "ddp"
        else _zeroshard_runner(workload, args.mode, n, extra, device)
        for n in names
    }
    times: dict[str, list[float]] = {n: [] for n in names}
    phases: dict[str, list[list[float]]] = {n: [] for n in names}
    step_peaks: dict[str, list[float]] = {n: [] for n in names}  # CUDA: MiB above the step's start
    cpu: dict[str, list[float]] = {n: [] for n in names}  # rank 0's process CPU ms (steadier when shared)
    for i in range(workload.total_steps):
        x, y = (t.to(device) for t in plan.batch(i, rank))
        for name, step in runners.items():
            dist.barrier()
            synchronize(device)
            if on_cuda:
                resting = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            phase = step(x, y)
            synchronize(device)
            cpu_ms = (time.process_time() - cpu_start) * 1e3
            elapsed = torch.tensor([time.perf_counter() - start], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= workload.warmup:
                times[name].append(elapsed.item() * 1e3)
                cpu[name].append(cpu_ms)
                phases[name].append([p * 1e3 for p in phase])
                if on_cuda:
                    step_peaks[name].append((torch.cuda.max_memory_allocated(device) - resting) / 2**20)
    if rank == 0:
        import zeroshard

        base = statistics.median(times[names[0]])
        cpu_base = statistics.median(cpu[names[0]])
        rows = []
        for name in names:
            median = statistics.median(times[name])
            fwd, bwd, opt = (statistics.median(p[j] for p in phases[name]) for j in range(3))
            # Step by step against the first engine (the same batch, moments apart), then the
            # median: steadier than a ratio of medians when the machine's load moves a lot.
            paired = statistics.median(t / b for t, b in zip(times[name], times[names[0]], strict=True))
            paired_cpu = statistics.median(t / b for t, b in zip(cpu[name], cpu[names[0]], strict=True))
            # sN against sN-bare when both ran: the hang watchdog's cost, paired the same way.
            bare = f"{name}-bare" if f"{name}-bare" in times else None
            rows.append({"engine": name, "step_ms": median, "ratio": median / base,
                         "paired_ratio": paired, "paired_cpu_ratio": paired_cpu,
                         "paired_vs_bare": None if bare is None else statistics.median(
                             t / b for t, b in zip(times[name], times[bare], strict=True)),
                         "paired_cpu_vs_bare": None if bare is None else statistics.median(
                             t / b for t, b in zip(cpu[name], cpu[bare], strict=True)),
                         "cpu_ms": statistics.median(cpu[name]),
                         "cpu_ratio": statistics.median(cpu[name]) / cpu_base,
                         "forward_ms": fwd, "backward_ms": bwd, "step_phase_ms": opt,
                         "step_peak_over_resting_mib": max(step_peaks[name]) if step_peaks[name] else None})
        meta = {"world_size": args.world_size, "mode": args.mode, "model": args.model, "steps": args.steps,
                "device": args.device, "gpu": torch.cuda.get_device_name(device) if on_cuda else None,
                "cuda_max_memory_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20 if on_cuda else None,
                "config_extra": extra,
                "zeroshard": str(Path(zeroshard.__file__).parent.parent), "torch": torch.__version__,
                "load_average": os.getloadavg()}
        return {"meta": meta, "rows": rows}
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mode", default="fp32", choices=["fp32", "bf16", "autocast", "fp16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: gloo (default); cuda: NCCL, rank r on cuda:r")
    parser.add_argument("--engines", default="ddp,s0,s1,s2,s3", help="ddp and/or sN (zeroshard stage N); "
                        "ratios are to the first; s3-nodirectuse: stage 3 without its direct-use mode; sN-bare: "
                        "stage N without the hang watchdog's record and channels (docs/reliability.md); sN-det: "
                        "stage N with the deterministic reduction")
    parser.add_argument("--config-extra", default="{}", help="JSON merged into every zeroshard config, e.g. "
                        "'{\"zero_optimization\": {\"reduce_bucket_size\": 200000}}'")
    parser.add_argument("--model", default="small")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--zeroshard-root", default=str(HERE.parent), help="checkout to import zeroshard from")
    parser.add_argument("--port", type=int, default=29641)
    parser.add_argument("--json", default=str(HERE / "results" / "interleaved.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from peers_device import check_device

    problem = check_device(args.device, args.world_size)
    if problem:
        parser.error(problem)
    args.zeroshard_root = str(Path(args.zeroshard_root).resolve())
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank_main, args=(args, args.port), nprocs=args.world_size, start_method="spawn")
    result = json.loads(Path(args.json).read_text())
    meta = result["meta"]
    print(f"{meta['mode']}, W={meta['world_size']}, {meta['model']}, {meta['steps']} steps, "
          f"zeroshard from {meta['zeroshard']}, config extra {json.dumps(meta['config_extra'])}"
          + (f", {meta['gpu']}" if meta.get("gpu") else ""))
    gpu = meta.get("gpu") is not None
    print(f"{'engine':>7} {'step ms':>8} {'ratio':>6} {'fwd':>7} {'bwd':>7} {'step':>7} {'cpu ms':>7} {'ratio':>6}"
          + (f" {'step peak MiB':>13}" if gpu else ""))
    for r in result["rows"]:
        print(f"{r['engine']:>7} {r['step_ms']:>8.1f} {r['ratio']:>6.3f} {r['forward_ms']:>7.1f} "
              f"{r['backward_ms']:>7.1f} {r['step_phase_ms']:>7.1f} {r['cpu_ms']:>7.1f} {r['cpu_ratio']:>6.3f}"
              + (f" {r['step_peak_over_resting_mib']:>13.1f}" if gpu else ""))
    paired = (f"{r['engine']} {r['paired_ratio']:.3f} (cpu {r['paired_cpu_ratio']:.3f})" for r in result["rows"])
    print(f"paired with {result['rows'][0]['engine']} step by step (median of per-step ratios): " + ", ".join(paired))
    against_bare = [f"{r['engine']} {r['paired_vs_bare']:.3f} (cpu {r['paired_cpu_vs_bare']:.3f})"
                    for r in result["rows"] if r.get("paired_vs_bare") is not None]
    if against_bare:
        print("paired with its -bare run (the hang watchdog's record and channels): " + ", ".join(against_bare))
    print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
