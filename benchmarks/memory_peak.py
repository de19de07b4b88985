"""Predicted against measured peak memory per rank, over the grid of issue 39.

    python benchmarks/memory_peak.py [--world-sizes 1 2 4] [--preset tiny] [--seq 64] [--micro-batch 4]

For every cell of stages 0-3 x offload (none, optimizer, optimizer+parameters where the stage
allows it) x activation checkpointing off/on x AdamW/Muon, on each world size: W processes
(gloo, CPU) build the demo GPT and the engine inside `zeroshard.memory.AllocationTracker` (the
CPU allocator's own count, docs/memory.md), train two steps, and take the peak of the second
(forward, backward, optimizer step); each rank also predicts its own peak with
`zeroshard.memory.predict_step` for the CPU, as `zeroshard explain --device cpu` does. Prints
one row per cell (the worst rank's ratio) and writes benchmarks/results/memory_peak.json.
On the CPU there is one memory: the measured peak is compared with the predicted device and
host bytes together.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.05  # issue 39's goal: every cell within 5%
STAGE_OFFLOADS = ((0, "none"), (1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"),
                  (3, "none"), (3, "optimizer"), (3, "optimizer+params"))


@dataclass(frozen=True)
class Cell:
    stage: int
    offload: str  # none, optimizer, optimizer+params
    checkpointing: bool
    optimizer: str  # adamw, muon
    preset: str = "tiny"
    seq: int = 64
    micro_batch: int = 4
    mode: str = "bf16"

    @property
    def name(self) -> str:
        ac = "ac" if self.checkpointing else "no-ac"
        return f"s{self.stage} {self.offload} {ac} {self.optimizer}"


def grid(presets: dict | None = None, optimizers=("adamw", "muon")) -> list[Cell]:
    return [Cell(stage, offload, ac, opt, **(presets or {}))
            for opt in optimizers for ac in (False, True) for stage, offload in STAGE_OFFLOADS]


def cell_config(cell: Cell) -> dict:
    # Stage 3 gathers every unit (the presets' blocks are below the default persistence threshold).
    zero: dict = {"stage": cell.stage, "stage3_param_persistence_threshold": 0}
    if cell.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu"}
    if cell.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu"}
    optimizer = ({"type": "AdamW", "params": {"lr": 1e-4}} if cell.optimizer == "adamw"
                 else {"type": "Muon", "params": {"lr": 1e-3}})
    config = {"train_micro_batch_size_per_gpu": cell.micro_batch, "gradient_accumulation_steps": 1,
              "optimizer": optimizer, "zero_optimization": zero, "steps_per_print": 10**9}
    if cell.mode == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def measure(cell: Cell) -> dict:
    """This rank's peak over the second training step (bytes), by phase: the allocator's count
    (on from before the model is built) above what was alive before, profiled in that step only."""
    import torch
    import torch.distributed as dist

    import zeroshard
    from zeroshard.memory import AllocationTracker, enable_cpu_memory_reporting
    from zeroshard.models import build_gpt

    enable_cpu_memory_reporting()
    gc.collect()
    torch.manual_seed(0)
    base = AllocationTracker.live_bytes()
    model = build_gpt(cell.preset, activation_checkpointing=cell.checkpointing)
    engine, *_ = zeroshard.initialize(model=model, config=cell_config(cell))
    generator = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randint(0, 256, (cell.micro_batch, cell.seq), generator=generator)
    y = torch.randint(0, 256, (cell.micro_batch, cell.seq), generator=generator)
    for step in range(2):
        tracker = AllocationTracker() if step == 1 else None
        with tracker or contextlib.nullcontext():
            with tracker.phase("forward") if tracker else contextlib.nullcontext():
                loss = engine(x, y)[1]  # the logits die here, as in the prediction
            with tracker.phase("backward") if tracker else contextlib.nullcontext():
                engine.backward(loss)
            with tracker.phase("step") if tracker else contextlib.nullcontext():
                engine.step()
            del loss
    engine.destroy()
    del engine, model
    gc.collect()
    above = tracker.zero_bytes - base
    phases = {name: p.peak_bytes + above for name, p in tracker.phases.items()}
    starts = {name: p.start_bytes + above for name, p in tracker.phases.items()}
    return {"peak": max(phases.values()), "phases": phases, "starts": starts}


def predict(cell: Cell, world_size: int, rank: int) -> dict:
    from zeroshard.memory import predict_step, preset_spec
    from zeroshard.resolve import resolve_config

    config = resolve_config(cell_config(cell), world_size=world_size)
    trace = predict_step(preset_spec(cell.preset), config, world_size, micro_batch=cell.micro_batch,
                         seq=cell.seq, activation_checkpointing=cell.checkpointing, device_type="cpu", rank=rank,
                         both_checkpointing=False)
    return {"peak": trace.combined.bytes, "phase": trace.combined.phase, "phases": trace.phase_peaks,
            "parts": trace.combined.parts}


def run_cells(cells: list[Cell]) -> list[dict]:
    """Every cell on this rank (inside a process group): measured and predicted."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for cell in cells:
        measured = measure(cell)
        predicted = predict(cell, world, rank)
        rows.append({"cell": asdict(cell), "name": cell.name, "world_size": world, "rank": rank,
                     "measured": measured, "predicted": predicted,
                     "ratio": predicted["peak"] / measured["peak"]})
    return rows


def _worker(rank: int, world: int, port: int, cells: list[Cell], queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put({"rank": rank, "rows": run_cells(cells)})
    finally:
        dist.destroy_process_group()


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.host_memory import spawn_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--optimizers", nargs="+", default=["adamw", "muon"])
    parser.add_argument("--only", default="", help="run the cells whose name contains this")
    args = parser.parse_args()
    cells = [c for c in grid({"preset": args.preset, "seq": args.seq, "micro_batch": args.micro_batch},
                             tuple(args.optimizers)) if args.only in c.name]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows: list[dict] = []
    started = time.perf_counter()
    for world in args.world_sizes:
        results = spawn_ranks(_worker, world, (cells,), "memory_peak", timeout_s=3600)
        by_cell: dict[str, list[dict]] = {}
        for result in results:
            for row in result["rows"]:
                by_cell.setdefault(row["name"], []).append(row)
        for name, ranks in by_cell.items():
            worst = max(ranks, key=lambda r: abs(r["ratio"] - 1))
            rows.append({"name": name, "world_size": world, "ranks": ranks, "worst_ratio": worst["ratio"]})
            mib = 2**20
            print(f"W={world} {name:32s} measured {worst['measured']['peak'] / mib:8.2f} MiB  predicted "
                  f"{worst['predicted']['peak'] / mib:8.2f} MiB  ratio {worst['ratio']:.3f}  "
                  f"({worst['predicted']['phase']})", flush=True)
    misses = [r for r in rows if abs(r["worst_ratio"] - 1) > TOLERANCE]
    ratios = sorted(r["worst_ratio"] for r in rows)
    print(f"{len(rows)} cells in {time.perf_counter() - started:.0f} s: median ratio {ratios[len(ratios) // 2]:.3f}, "
          f"range {ratios[0]:.3f}-{ratios[-1]:.3f}, {len(misses)} outside {TOLERANCE:.0%}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "memory_peak.json"
    out.write_text(json.dumps({"preset": args.preset, "seq": args.seq, "micro_batch": args.micro_batch,
                               "tolerance": TOLERANCE, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
