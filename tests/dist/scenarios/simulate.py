"""Tasks for tests/dist/tools/test_simulate_validation.py: one rank's measurements, taken by
the same code (zeroshard.tools.simulate.train_and_measure) on a real gloo group and on a
simulated one."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from zeroshard.models import build_model
from zeroshard.resolve import resolve_config
from zeroshard.tools.simulate import SimulateOptions, make_runner, simulate, train_and_measure

SEQ, WARMUP = 16, 2
KEYS = ("model_states_bytes", "peak_device_allocated_bytes", "device_baseline_bytes", "collectives")


def measure_real(raw: dict, model: str, repeats: int) -> list[dict]:
    """`raw` trained `repeats` times on this gloo group, each time a fresh engine on a model
    built whole on every rank and sharded by the engine; this rank's measurements."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cpu")
    resolved = resolve_config(copy.deepcopy(raw), world_size=world)
    results = []
    for _ in range(repeats):
        gen = torch.Generator().manual_seed(1234 + rank)

        def tokens(gen=gen) -> torch.Tensor:
            return torch.randint(0, 256, (resolved.train_micro_batch_size_per_gpu, SEQ), generator=gen)

        def factory():
            return make_runner("zeroshard", raw, lambda: build_model(model), device, resolved, zero_init=False)

        runner, measured = train_and_measure(factory, tokens, resolved.gradient_accumulation_steps, WARMUP, device)
        runner.engine.destroy()
        del runner
        results.append({key: measured[key] for key in KEYS})
    return results


def measure_simulated(runs: list[tuple[dict, str, int, int, bool]]) -> list[dict]:
    """Each (config, model, world size, rank, zero_init) simulated in this process (which must
    have no process group: a simulated world is the default group)."""
    reports = []
    for raw, model, world, rank, zero_init in runs:
        options = SimulateOptions(raw, world, rank, model=model, seq=SEQ, steps=1, warmup=WARMUP, zero_init=zero_init)
        reports.append(simulate(options))
    return reports
