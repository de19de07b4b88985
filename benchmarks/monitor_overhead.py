"""The step-time cost of the monitors: csv_monitor, tensorboard and wandb (offline) all on,
against all off, on the demo GPT at steps_per_print 10.

    python benchmarks/monitor_overhead.py                         # "small" demo model, CPU
    python benchmarks/monitor_overhead.py --model tiny --rounds 5 --steps 20 --json out.json

Two engines are built from the same initial weights, one with every monitor on, one with none,
and trained in turn: each round runs `--steps` steps of one, then of the other, so load from
other processes on a shared machine falls on both alike. Reported per engine: the median step
time (forward + backward + step) over all timed steps, the median main-thread CPU time of a
step (what the training thread itself spent, whatever else the machine ran), and the overhead
on / off - 1 of each. As that
difference is within the noise of a shared CPU, the engine's own monitoring work is also timed
alone: `note_loss` plus `after_step` (building the step's events and queueing them for the
writer thread) per step, median over the steps of the "on" engine. A benchmark, not a test:
nothing asserts; the target is under 2%.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # zeroshard from the checkout

import zeroshard  # noqa: E402
from zeroshard.demo.train import default_config  # noqa: E402
from zeroshard.models import GPT, PRESETS  # noqa: E402


def monitor_sections(out_dir: str, wanted: list[str]) -> dict:
    """The config sections of the `wanted` monitors (those whose package is installed)."""
    sections = {
        "csv_monitor": {"enabled": "csv_monitor" in wanted, "output_path": out_dir, "job_name": "bench"},
        "tensorboard": {"enabled": "tensorboard" in wanted and importlib.util.find_spec("tensorboard") is not None,
                        "output_path": out_dir, "job_name": "bench"},
        "wandb": {"enabled": "wandb" in wanted and importlib.util.find_spec("wandb") is not None,
                  "project": "zeroshard-bench"},
    }
    return sections


def build(model_name: str, micro: int, monitors: dict | None, seed: int):
    torch.manual_seed(seed)
    model = GPT(PRESETS[model_name])
    config = default_config(total_steps=10_000, on_gpu=False)
    config["train_micro_batch_size_per_gpu"] = micro
    config["steps_per_print"] = 10
    config.update(monitors or {})
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      dist_init_required=False, config=config)
    return engine


class TimedFigures:
    """Wraps an engine's TrainingFigures to time its two calls (the monitoring work of a step)."""

    def __init__(self, figures) -> None:
        self._figures = figures
        self.per_step_s: list[float] = []
        self._pending = 0.0

    def note_loss(self, loss) -> None:
        start = time.perf_counter()
        self._figures.note_loss(loss)
        self._pending += time.perf_counter() - start

    def after_step(self, *args, **kwargs) -> None:
        start = time.perf_counter()
        self._figures.after_step(*args, **kwargs)
        self.per_step_s.append(self._pending + time.perf_counter() - start)
        self._pending = 0.0

    def __getattr__(self, name):
        return getattr(self._figures, name)


def train_steps(engine, batches) -> tuple[list[float], list[float]]:
    """Wall and main-thread CPU seconds per step. CPU time leaves out waiting for other
    processes (the machine's other jobs, wandb's service) and for the writer thread's GIL."""
    wall, cpu = [], []
    for x, y in batches:
        start, start_cpu = time.perf_counter(), time.thread_time()
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    return wall, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--micro", type=int, default=8, help="micro-batch (the demo's is 16)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps per engine per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--monitors", default="csv_monitor,tensorboard,wandb", help="which to turn on")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    out_dir = tempfile.mkdtemp(prefix="zeroshard-monitor-bench-")
    os.environ.setdefault("WANDB_DIR", out_dir)
    sections = monitor_sections(out_dir, args.monitors.split(","))
    block = PRESETS[args.model].block_size
    gen = torch.Generator().manual_seed(0)

    def batches(n):
        data = torch.randint(0, 256, (n, args.micro, block + 1), generator=gen)
        return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]

    engines = {"off": build(args.model, args.micro, None, 0), "on": build(args.model, args.micro, sections, 0)}
    timed = TimedFigures(engines["on"].training_figures)
    engines["on"].training_figures = timed
    for engine in engines.values():
        train_steps(engine, batches(args.warmup))
    timed.per_step_s.clear()
    step_times: dict[str, list[float]] = {"off": [], "on": []}
    cpu_times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for name in ("off", "on"):  # the same batches for both, in turn
            wall, cpu = train_steps(engines[name], batches(args.steps))
            step_times[name] += wall
            cpu_times[name] += cpu
    engines["on"].destroy()  # flush and close, outside the timed steps
    engines["off"].destroy()

    median_ms = {name: statistics.median(t) * 1e3 for name, t in step_times.items()}
    cpu_ms = {name: statistics.median(t) * 1e3 for name, t in cpu_times.items()}
    hook_us = statistics.median(timed.per_step_s) * 1e6
    result = {
        "model": args.model, "micro_batch": args.micro, "steps_per_print": 10,
        "rounds": args.rounds, "steps_per_round": args.steps,
        "monitors_on": [k for k, v in sections.items() if v["enabled"]],
        "median_step_ms_off": median_ms["off"], "median_step_ms_on": median_ms["on"],
        "overhead_percent": (median_ms["on"] / median_ms["off"] - 1) * 100,
        "median_step_cpu_ms_off": cpu_ms["off"], "median_step_cpu_ms_on": cpu_ms["on"],
        "cpu_overhead_percent": (cpu_ms["on"] / cpu_ms["off"] - 1) * 100,
        "monitor_work_per_step_us": hook_us,
        "monitor_work_percent": hook_us / 1e3 / median_ms["off"] * 100,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "output_dir": out_dir,
    }
    print(f"demo model {args.model!r}, micro-batch {args.micro}, steps_per_print 10, CPU, "
          f"{args.rounds} rounds x {args.steps} steps per engine; monitors on: {', '.join(result['monitors_on'])}")
    print(f"{'':30} {'median step (ms)':>18} {'main-thread CPU (ms)':>22}")
    print(f"{'monitors off':30} {median_ms['off']:18.2f} {cpu_ms['off']:22.2f}")
    print(f"{'monitors on':30} {median_ms['on']:18.2f} {cpu_ms['on']:22.2f}")
    print(f"{'overhead (on / off - 1)':30} {result['overhead_percent']:17.2f}% {result['cpu_overhead_percent']:21.2f}%")
    print(f"{'monitoring work per step':30} {hook_us:15.1f} us  ({result['monitor_work_percent']:.4f}% of a step)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
