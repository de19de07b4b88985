"""The GPU check at world N: `bash scripts/gpu_check.sh OUTDIR --device cuda --nproc N` (one process
per GPU, NCCL; `--device cpu --nproc 2` runs the same code on gloo, small, in CI).

    python -m torch.distributed.run --standalone --nproc_per_node N -m benchmarks.gpu_check.multi OUTDIR

Rows (rank 0 writes OUTDIR/gpu_check.json and gpu_check.txt; every rank runs every row):
- a/conformance sS MODE @N: the CPU matrix's case (tests/dist/scenarios: the TinyModel,
  micro-batch 2, 2 accumulation steps, 3 steps) trained at world N on the devices, against the
  single-process reference on the device with the CPU tolerances (as check a at world 1).
- f/model PRESET ENGINE @N: the model benchmark at world N: plain (each rank alone, no
  communication: the compute floor), ddp, fsdp2 (fully_shard per block) and zeroshard stages
  0-3, bf16. Per engine: tokens/s per GPU, the step (each step timed with CUDA events, the
  slowest rank's median), peak allocated memory (the largest rank's), and the exposed
  communication: the step minus the same rank's compute step, which each rank measures first,
  before any process group exists, as its own simulated rank (zeroshard simulate, no fabric:
  the same engine, model and micro-batch with collectives taking no time); DDP's is its step
  minus the plain loop's. Presets: the demo's `1b` (sequence 2048) and Llama-3 `8b` (sequence
  4096, micro-batch 1: stages 2-3 and FSDP2, the rest do not fit one device's memory at any N
  up to 8 and are skipped, saying so); on the CPU the demo's `tiny`.
Under 10 minutes on 8 GPUs of the H100 class (prepared; not measured on a GPU yet).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.gpu_check.report import Report, Skip

ADAMW = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CONFORMANCE_MODES = ("fp32", "bf16", "autocast_bf16", "fp16")


@dataclass(frozen=True)
class Bench:
    preset: str
    seq: int
    micro: int
    engines: tuple[str, ...]
    skipped: tuple[str, ...] = ()  # engines that cannot fit, named as skips


def benches(device: torch.device) -> list[Bench]:
    if device.type != "cuda":
        return [Bench("tiny", 64, 2, ("plain", "ddp", "fsdp2", "zeroshard-s3"))]
    return [
        Bench("1b", 2048, 4, ("plain", "ddp", "fsdp2", "zeroshard-s0", "zeroshard-s1", "zeroshard-s2",
                              "zeroshard-s3")),
        Bench("8b", 4096, 1, ("fsdp2", "zeroshard-s2", "zeroshard-s3"),
              skipped=("plain", "ddp", "zeroshard-s0", "zeroshard-s1")),
    ]


def zeroshard_config(stage: int, micro: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": ADAMW}, "zero_optimization": {"stage": stage},
            "steps_per_print": 10**9}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ------------------------------------------------------------------ simulated compute steps


def simulated_compute_steps(device: torch.device, rank: int, world: int, steps: int, wanted) -> dict[str, float]:
    """This rank's compute step per (preset, engine) of the rows `wanted` keeps, simulated (before
    any process group)."""
    from zeroshard.tools.simulate import SimulateOptions, simulate

    out: dict[str, float] = {}
    for bench in benches(device):
        for engine in bench.engines:
            if engine in ("plain", "ddp") or not wanted(f"f/model {bench.preset} {engine} @{world}"):
                continue
            stage = int(engine[-1]) if engine.startswith("zeroshard") else 3
            options = SimulateOptions(
                zeroshard_config(stage, bench.micro), world, rank, model=bench.preset, seq=bench.seq, steps=steps,
                device=device.type, engine="fsdp2" if engine == "fsdp2" else "zeroshard",
            )
            try:
                out[f"{bench.preset} {engine}"] = simulate(options)["compute_step_s"]
            except torch.OutOfMemoryError:
                pass
            _fresh(device)
    return out


# ------------------------------------------------------------------------------- runners


class _Plain:
    """fp32 parameters, forward under autocast(bf16), fused AdamW on CUDA, clip_grad_norm_:
    each rank alone (no communication), the compute floor; `ddp` wraps the same model."""

    def __init__(self, bench: Bench, device: torch.device, ddp: bool) -> None:
        from zeroshard.models import build_model

        with device:
            self.model = build_model(bench.preset)
        if ddp:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(self.model, gradient_as_bucket_view=True)
        self.device = device
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), **{**ADAMW, "betas": tuple(ADAMW["betas"])}, **fused)

    def micro_step(self, tokens: torch.Tensor, boundary: bool, count_states: bool = False) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            _, loss = self.model(tokens, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _runner(engine: str, bench: Bench, device: torch.device):
    from zeroshard.models import build_model
    from zeroshard.resolve import resolve_config
    from zeroshard.tools.simulate import make_runner

    if engine in ("plain", "ddp"):
        return _Plain(bench, device, ddp=engine == "ddp")
    stage = int(engine[-1]) if engine.startswith("zeroshard") else 3
    raw = zeroshard_config(stage, bench.micro)
    resolved = resolve_config(dict(raw), world_size=dist.get_world_size())
    return make_runner("fsdp2" if engine == "fsdp2" else "zeroshard", raw, lambda: build_model(bench.preset),
                       device, resolved)


def model_row(engine: str, bench: Bench, device: torch.device, warmup: int, steps: int,
              compute: dict[str, float], floor: dict[str, float]) -> dict[str, Any]:
    """One engine at world N; every rank runs it, the numbers are gathered to every rank."""
    _fresh(device)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    vocab = 256 if bench.preset in ("tiny", "1b") else 128256
    batches = [torch.randint(0, vocab, (bench.micro, bench.seq), generator=gen).to(device) for _ in range(2)]
    runner = _runner(engine, bench, device)
    try:
        for i in range(warmup):
            runner.micro_step(batches[i % 2], boundary=True)
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(steps):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                runner.micro_step(batches[i % 2], boundary=True)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                runner.micro_step(batches[i % 2], boundary=True)
                times.append(time.perf_counter() - began)
        mine = {"step_s": statistics.median(times),
                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0}
    finally:
        if hasattr(runner, "engine"):
            runner.engine.destroy()
        del runner
        _fresh(device)
    key = f"{bench.preset} {engine}"
    reference = floor.get(bench.preset) if engine == "ddp" else compute.get(key)
    mine["exposed_s"] = mine["step_s"] - reference if reference is not None and engine != "plain" else None
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    step = max(r["step_s"] for r in everyone)
    exposed = [r["exposed_s"] for r in everyone if r["exposed_s"] is not None]
    out = {"micro": bench.micro, "seq": bench.seq, "step_s": step,
           "tokens_s_per_gpu": bench.micro * bench.seq / step, "peak_alloc_gib": max(r["peak_gib"] for r in everyone),
           "exposed_comm_s": statistics.median(exposed) if exposed else 0.0}
    if engine == "plain":
        floor[bench.preset] = statistics.median(r["step_s"] for r in everyone)
    return out


# ---------------------------------------------------------------------------- conformance


def conformance(stage: int, mode: str, device: torch.device) -> dict[str, Any] | tuple[str, dict[str, Any], str]:
    """Check a at world N: the case trained on the devices against the reference on the device."""
    from benchmarks.gpu_check.conformance import to_cpu
    from tests.dist.reference import check_against_reference, reference_for, world_losses
    from tests.dist.scenarios.common import Case, build_engine, my_micro_batch, train

    case = Case(stage=stage, mode=mode, micro=2, ga=2, steps=3)

    def step(engine, case, batch) -> list[float]:
        losses = []
        for j in range(case.ga):
            tokens, targets = my_micro_batch(batch, j, case)
            loss = engine(tokens.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            losses.append(float(loss.detach()))
            if j < case.ga - 1:
                engine.step()
        return losses

    engine = build_engine(case)
    try:
        result = to_cpu(train(engine, case, step_fn=step))
    finally:
        engine.destroy()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    ref = reference_for(case, world_size=dist.get_world_size(), device=str(device))
    losses = world_losses([[r] for r in per_rank], 0)
    try:
        check_against_reference(per_rank[0], ref, mode, case.settings, losses, case.label)
    except AssertionError as error:
        return "FAIL", {}, str(error)
    return {"world": dist.get_world_size(), "loss_last": losses[-1]}


# ---------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_check.multi", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--only", default="", help="comma-separated row-name prefixes to run")
    args = parser.parse_args(argv)
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if args.device == "cuda":
        if torch.cuda.device_count() < world:
            print(f"gpu_check: --nproc {world} but {torch.cuda.device_count()} CUDA devices", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    warmup, steps = (1, 2) if args.device == "cpu" or args.quick else (2, 5)
    only = [p for p in args.only.split(",") if p]

    def wanted(name: str) -> bool:
        return not only or any(name.startswith(p) for p in only)

    # Before any process group: each rank's compute step, simulated (no fabric).
    compute = simulated_compute_steps(device, rank, world, steps, wanted)
    import zeroshard

    zeroshard.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", timeout=300)
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(local) if device.type == "cuda" else platform.processor() or "cpu",
            "world_size": world, "torch": torch.__version__, "argv": sys.argv}
    report = Report(args.outdir if rank == 0 else args.outdir / f"rank{rank}", meta)
    started = time.perf_counter()
    quiet = contextlib.redirect_stdout(open(os.devnull, "w")) if rank else contextlib.nullcontext()  # noqa: SIM115
    with quiet:
        stages = (0, 1, 2, 3)
        modes = CONFORMANCE_MODES if device.type == "cuda" else ("fp32",)
        for stage in stages:
            for mode in modes:
                name = f"a/conformance s{stage} {mode} @{world}"
                if wanted(name):
                    report.run(name, lambda s=stage, m=mode: conformance(s, m, device), 180)
        floor: dict[str, float] = {}
        for bench in benches(device):
            for engine in bench.skipped:
                name = f"f/model {bench.preset} {engine} @{world}"
                if wanted(name):
                    report.run(name, lambda: (_ for _ in ()).throw(Skip(
                        "does not fit one device: full bf16 or fp32 parameters, gradients and AdamW state")), 5)
            for engine in bench.engines:
                name = f"f/model {bench.preset} {engine} @{world}"
                if wanted(name):
                    report.run(name, lambda e=engine, b=bench: model_row(e, b, device, warmup, steps, compute, floor),
                               300)
    report.meta["seconds"] = round(time.perf_counter() - started, 1)
    report._write()
    if rank == 0:
        table = report.table()
        (args.outdir / "gpu_check.txt").write_text(table + "\n")
        print(table, flush=True)
    failed = any(r.status == "FAIL" for r in report.rows)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
