"""One benchmark run: one engine, one precision mode, on every rank torchrun started.

Every rank trains `warmup + steps` steps on its own windows of the shared text. Before each
step the ranks meet at a barrier (not timed), so a step's time is the slowest rank's time for
the same work (floor-par's independent processes skip the barrier; their step i is still
taken as the slowest rank's step i). Rank 0 writes one JSON object with the medians, memory per rank, communication
per step and the loss curve (the global mean loss of every step).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peers_device import init_group, local_device, memory_stats, synchronize
from peers_engines import make_runner
from peers_measure import current_rss_bytes, live_tensor_bytes, peak_rss_bytes, wire_bytes_per_rank
from peers_workload import BatchPlan, Workload
from process_group import close_group

# Steps profiled after warm-up when --profile-out is given.
_PROFILED_STEPS = 5


def _import_engine(engine: str) -> None:
    """Import the engine's package before the baseline RSS is taken, so that imports do not count."""
    if engine == "deepspeed":
        import deepspeed  # noqa: F401
    elif engine == "zeroshard":
        import zeroshard.engine.engine  # noqa: F401


def run(args: Any) -> dict[str, Any] | None:
    """Train and measure; rank 0 returns the result (other ranks None)."""
    distributed = args.engine != "floor"
    # floor-par: W processes that train independently; the process group only collects results.
    lockstep = args.engine != "floor-par"
    where = getattr(args, "device", "cpu")
    device = init_group(where) if distributed else local_device(where)
    world = dist.get_world_size() if distributed else args.world_size
    rank = dist.get_rank() if distributed else 0
    workload = Workload(args.model, world, args.global_batch, args.steps, args.warmup, args.seed,
                        getattr(args, "optimizer", "adamw"))
    _import_engine(args.engine)
    baseline_rss = current_rss_bytes()

    runner = make_runner(args.engine, workload, args.mode, args.stage, args.reshard, device)
    batches = BatchPlan(workload)
    step_times: list[float] = []
    cpu_times: list[float] = []
    phase_times: list[list[float]] = []
    losses: list[torch.Tensor] = []
    profiler = None
    with runner.recording() as log:
        for step in range(workload.total_steps):
            timed = step >= workload.warmup
            if args.profile_out and rank == 0 and step == workload.warmup:
                activities = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                profiler = torch.profiler.profile(activities=activities)
                profiler.__enter__()
            if step == workload.warmup and log is not None:
                log.records.clear()  # warm-up collectives (the init broadcasts) are not a step's
            if step == workload.warmup and device.type == "cuda":
                startup_peak = memory_stats(device)  # set-up and warm-up, before the steady state
                torch.cuda.reset_peak_memory_stats(device)
            x, y = (t.to(device) for t in batches.batch(step, rank))
            if distributed and lockstep:
                dist.barrier()
            synchronize(device)  # nothing queued from before counts in this step
            t0, c0 = time.perf_counter(), time.process_time()
            loss, phases = runner.train_step(x, y)
            synchronize(device)  # the step's kernels, not just their launches
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            losses.append(loss.float())
            if timed:
                step_times.append(elapsed)
                cpu_times.append(cpu)
                phase_times.append(phases)
            if profiler is not None and step == workload.warmup + _PROFILED_STEPS - 1:
                profiler.__exit__(None, None, None)
                _write_profile(profiler, args.profile_out)
                profiler = None
        if profiler is not None:  # fewer timed steps than _PROFILED_STEPS
            profiler.__exit__(None, None, None)
            _write_profile(profiler, args.profile_out)
        comm_by_op, comm_source = runner.comm_per_step(log, workload.steps)

    # One more step, untimed and not in the loss curve, to count memory between its backward
    # and its optimizer step, where parameters, gradients and optimizer state all exist.
    held: dict[str, Any] = {}

    def count_held() -> None:
        counter = runner.model_states()
        held.update(by_role=dict(counter.by_role), total=counter.total, live=live_tensor_bytes())

    x, y = (t.to(device) for t in batches.batch(workload.total_steps - 1, rank))
    if distributed and lockstep:
        dist.barrier()
    runner.train_step(x, y, after_backward=count_held)
    mine = {
        "rank": rank,
        "step_times": step_times,
        "cpu_times": cpu_times,
        "phase_times": phase_times,
        "model_states": held["by_role"],
        "model_state_bytes": held["total"],
        "live_tensor_bytes": held["live"],
        "peak_rss_bytes": peak_rss_bytes(),
        "baseline_rss_bytes": baseline_rss,
        # CUDA only: allocator peaks over the timed steps and the memory-count step, and over
        # set-up and warm-up before them.
        **memory_stats(device),
        **({f"startup_{k}": v for k, v in startup_peak.items()} if device.type == "cuda" else {}),
    }
    loss_curve = torch.stack(losses).to(device)
    if distributed:
        dist.all_reduce(loss_curve)
        loss_curve /= world
        per_rank: list[Any] = [None] * world
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    extra = runner.extra()
    num_params = runner_num_params(runner)
    if distributed:
        dist.barrier()
        # The runner (DDP, FSDP, DeepSpeed or zeroshard) and what refers to it go before the group
        # (benchmarks/process_group.py: a DDP freed after the group can deadlock the exit).
        del runner, count_held, log
        close_group()
    if rank != 0:
        return None

    # A step takes as long as its slowest rank.
    slowest = [max(r["step_times"][i] for r in per_rank) for i in range(workload.steps)]
    phases = [statistics.median(p[i] for p in per_rank[0]["phase_times"]) for i in range(3)]
    # CPU seconds the process used per step (all its threads, gloo's included): unlike wall
    # time, it barely moves when other work shares the cores.
    cpu_per_step = [max(r["cpu_times"][i] for r in per_rank) for i in range(workload.steps)]
    median = statistics.median(slowest)
    return {
        "engine": args.engine,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "mode": args.mode,
        "stage": args.stage,
        "reshard": args.reshard,
        "world_size": world,
        "workload": {
            "model": workload.preset,
            "global_batch": workload.global_batch,
            "micro_batch": workload.micro_batch,
            "seq_len": workload.seq_len,
            "steps": workload.steps,
            "warmup": workload.warmup,
            "seed": workload.seed,
            "num_params": num_params,
        },
        "omp_num_threads": torch.get_num_threads(),
        "median_step_s": median,
        "step_times_s": slowest,
        "median_cpu_s": statistics.median(cpu_per_step),
        "cpu_times_s": cpu_per_step,
        "rank0_phase_median_s": dict(zip(("forward", "backward", "step"), phases, strict=True)),
        "tokens_per_s": workload.tokens_per_step / median,
        "comm_bytes_per_step": comm_by_op,
        "comm_total_bytes_per_step": sum(comm_by_op.values()),
        "comm_wire_bytes_per_rank": wire_bytes_per_rank(comm_by_op, world),
        "comm_source": comm_source,
        "loss_curve": loss_curve.cpu().tolist(),
        "final_loss": float(loss_curve[-1]),
        "per_rank": [
            {k: v for k, v in r.items() if k not in ("step_times", "cpu_times", "phase_times")} for r in per_rank
        ],
        **extra,
    }


def runner_num_params(runner: Any) -> int:
    """Parameter elements of the model (the tied embedding once), whatever wraps it."""
    numel_root = getattr(runner, "numel_root", None)
    if numel_root is not None:
        return numel_root + runner.numel_blocks
    return sum(f.numel for f in runner.engine.flats)


def _write_profile(profiler: Any, out_dir: str) -> None:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    table = profiler.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    (path / "profile_cpu_total.txt").write_text(table)
    table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    (path / "profile_self_cpu.txt").write_text(table)


def main(args: Any) -> int:
    result = run(args)
    if result is not None:
        text = json.dumps(result, indent=1)
        if args.result_file:
            Path(args.result_file).write_text(text)
        else:
            sys.stdout.write(text + "\n")
    return 0

