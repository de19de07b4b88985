"""Scaling, simulated on one device: zeroshard beside FSDP2, rank R of W-rank jobs (docs/simulate.md).

    python benchmarks/simulate_scale.py --device cuda                      # the issue's grid (one GPU)
    python benchmarks/simulate_scale.py --device cpu --grid cpu           # the same rows, small, on a CPU

Each row is one `zeroshard.tools.simulate.simulate` run (in this process, one after another):
the model built at its real size, trained by the engine as rank W-1 of W on the simulated
process group, timed without a fabric and with each fabric preset in turn. The table gives, per
row and engine: model states and peak allocated memory per rank, the compute step, and the
exposed communication per fabric (fabric step - compute step) with the modelled wire time
beside it. `--world-1` adds the check of the harness against reality: the world-1 row simulated
and the same config run for real on a process group of one (its compute step within 10%).
Everything printed is simulated, and says so; the JSON goes to benchmarks/results/NAME.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeroshard.comm.fabric import PRESETS  # noqa: E402
from zeroshard.tools.simulate import SimulateOptions, simulate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def config(stage: int, micro: int = 1) -> dict:
    """bf16 with fp32 masters and accumulation (zeroshard's default), AdamW, clipping at 1."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }


# (model, overrides, world size, stage, sequence): the grid, and a CPU-sized stand-in.
GRIDS = {
    "gpu": [
        ("8b", {}, 8, 3, 4096), ("8b", {}, 8, 2, 4096), ("8b", {}, 64, 3, 4096), ("8b", {}, 64, 2, 4096),
        # Activation checkpointing per layer: 80 layers' activations at 4096 tokens do not fit beside the states.
        ("70b", {"checkpoint_activations": True}, 64, 3, 4096),
        ("70b", {"checkpoint_activations": True}, 512, 3, 4096),
    ],
    "cpu": [("small", {}, 8, 3, 128), ("small", {}, 8, 2, 128), ("small", {}, 64, 3, 128), ("small", {}, 512, 3, 128)],
}


def run_row(model: str, overrides: dict, world: int, stage: int, seq: int, engine: str, device: str,
            steps: int) -> dict:
    options = SimulateOptions(
        config(stage), world, world - 1, model=model, model_overrides=overrides, seq=seq, steps=steps,
        fabric=[PRESETS["nvlink"], PRESETS["ib"]], device=device, engine=engine,
    )
    try:
        return simulate(options)
    except torch.OutOfMemoryError as exc:
        return {"simulated": True, "error": f"out of device memory: {str(exc).splitlines()[0]}"}
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def world_one(model: str, overrides: dict, stage: int, seq: int, device: str, steps: int) -> dict:
    """The world-1 row simulated and run for real (a process group of one, gloo or NCCL): the
    harness's compute step against a real one's."""
    import torch.distributed as dist

    from zeroshard.models import build_model
    from zeroshard.resolve import resolve_config
    from zeroshard.tools.simulate import _timed_step, make_runner, train_and_measure

    sim = simulate(SimulateOptions(config(stage), 1, 0, model=model, model_overrides=overrides, seq=seq,
                                   steps=steps, device=device))
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    store = dist.HashStore()
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        raw = config(stage)
        resolved = resolve_config(copy.deepcopy(raw), world_size=1)
        gen = torch.Generator().manual_seed(1)
        vocab = sim_vocab(model)

        def tokens() -> torch.Tensor:
            return torch.randint(0, vocab, (1, seq), generator=gen).to(dev)

        runner, measured = train_and_measure(
            lambda: make_runner("zeroshard", raw, lambda: build_model(model, **overrides), dev, resolved),
            tokens, 1, 2, dev,
        )
        real = statistics.median(_timed_step(runner, tokens, 1, dev) for _ in range(steps))
        del runner
    finally:
        dist.destroy_process_group()
    # Peaks above what was already allocated when each measurement began (the simulated run's
    # leftovers are in the real run's baseline).
    sim_peak = sim["peak_device_allocated_bytes"] - sim["device_baseline_bytes"]
    real_peak = measured["peak_device_allocated_bytes"] - measured["device_baseline_bytes"]
    return {"simulated_compute_step_s": sim["compute_step_s"], "real_step_s": real,
            "ratio": sim["compute_step_s"] / real, "simulated_peak_bytes": sim_peak, "real_peak_bytes": real_peak,
            "peak_ratio": sim_peak / real_peak}


def sim_vocab(model: str) -> int:
    from zeroshard.models import preset_info

    return preset_info(model).vocab_size


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows: list[dict]) -> str:
    head = ("| model | W | stage | engine | states MiB/rank | peak alloc MiB | compute step s | exposed nvlink s "
            "(modelled) | exposed ib s (modelled) |")
    lines = ["(simulated: rank W-1 of W on one device; communication modelled, see docs/simulate.md)", "", head,
             "|---|--:|--:|---|--:|--:|--:|--:|--:|"]
    for row in rows:
        r = row["report"]
        label = f"| {row['model']} | {row['world']} | {row['stage']} | {row['engine']} |"
        if "error" in r:
            lines.append(f"{label} {r['error']} |||||")
            continue
        fab = {f["name"]: f for f in r.get("fabrics", [])}
        cells = [f"{fab[n]['exposed_comm_s']:.3f} ({fab[n]['modelled_comm_s']:.3f})" for n in ("nvlink", "ib")]
        lines.append(f"{label} {mib(r['model_states_bytes']['total'])} | {mib(r['peak_device_allocated_bytes'])} | "
                     f"{r['compute_step_s']:.3f} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grid", choices=sorted(GRIDS), help="rows (default: gpu on cuda, cpu on the CPU)")
    parser.add_argument("--engines", default="zeroshard,fsdp2")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--only", default="", help="comma-separated row prefixes, e.g. 8b-8,70b-64")
    parser.add_argument("--world-1", action="store_true", help="also check the world-1 row against a real run")
    parser.add_argument("--name", default=time.strftime("simulate_scale-%Y%m%d-%H%M%S"))
    parser.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/NAME.json)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("simulate_scale: --device cuda: no CUDA device is available", file=sys.stderr)
        return 2
    grid = GRIDS[args.grid or ("gpu" if args.device == "cuda" else "cpu")]
    only = [p for p in args.only.split(",") if p]
    rows = []
    out = args.out or RESULTS / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "simulated": True, "steps": args.steps}
    for model, overrides, world, stage, seq in grid:
        if only and not any(f"{model}-{world}".startswith(p) for p in only):
            continue
        for engine in args.engines.split(","):
            started = time.perf_counter()
            report = run_row(model, overrides, world, stage, seq, engine, args.device, args.steps)
            rows.append({"model": model, "overrides": overrides, "world": world, "stage": stage, "seq": seq,
                         "engine": engine, "report": report, "seconds": round(time.perf_counter() - started, 1)})
            print(f"simulated {model} W={world} stage {stage} {engine}: "
                  f"{report.get('error') or round(report['compute_step_s'], 3)} ({rows[-1]['seconds']} s)", flush=True)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    result = {"meta": meta, "rows": rows}
    if args.world_1:
        model, overrides, _, stage, seq = grid[0]
        result["world_1"] = world_one(model, overrides, stage, seq, args.device, args.steps)
        print(f"world 1, {model} stage {stage}: simulated compute step / real step = {result['world_1']['ratio']:.3f}")
    out.write_text(json.dumps(result, indent=1, default=str))
    print(table(rows))
    print(f"simulated results written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
