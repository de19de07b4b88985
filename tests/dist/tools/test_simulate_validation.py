"""A simulated rank (zeroshard simulate) against a real one, and against the ZeRO formula.

At world sizes 2 and 4, rank W-1 of a real gloo run and the same rank simulated in one process
train the same config and model (the demo GPT "tiny", built whole on every rank, then sharded
by the engine) through the same measuring code (zeroshard.tools.simulate.train_and_measure):
- model-state bytes by role: equal, byte for byte (the engine's buffers depend on the world
  size and rank only, not on the peers' data);
- the recorder's collectives per step (op, group size, dtype, bytes, count): equal;
- peak allocated memory (above what was allocated before): within 5% (tools/peak_memory.py
  leaves out gloo's own buffers and pauses the garbage collector, whose timing moved a real
  gloo rank's peak by a gradient bucket between identical runs; measured 0-1% here). The real
  peak is the lower of two runs: gloo's worker threads release a finished collective's tensors
  when the OS schedules them, which on this oversubscribed machine (4 ranks, 2 cores) kept a
  buffer alive past the next allocation in about 1 run in 20, only ever raising the real peak.
At 64 and 512 ranks, stage 3 fp32 built under zero.Init, the model states per rank equal the
formula 16 bytes x parameters / W (fp32 master, gradient and AdamW's two moments) plus the
persistent units' full parameters (units under stage3_param_persistence_threshold stay
gathered), within 1% (each flat is padded to a multiple of W)."""

from __future__ import annotations

import pytest

from tests.dist.scenarios.simulate import measure_real, measure_simulated
from zeroshard.models import build_model

BASE = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0, "steps_per_print": 1000}
# Every unit of "tiny" is under the default persistence threshold: 0 makes stage 3 gather them.
REAL_RUNS = {
    2: {**BASE, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
    4: {**BASE, "train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}},
}
FORMULA_MODEL = "small"  # 1.24 M parameters: padding stays under 0.3% at 512 ranks
FORMULA_RUNS = [(64, 5), (512, 511)]  # (world size, rank); fp32: a unit kept whole holds 4 bytes per parameter
PEAK_TOLERANCE = 0.05  # the bound; 0-1% measured here
FORMULA_TOLERANCE = 0.01  # padding: at most W-1 elements per flat


def _formula(world: int, whole_bytes: int, threshold: int = 100_000) -> float:
    """16 P / W plus the persistent units' parameters, from the model's own sizes: the units are
    its blocks and the root (everything else); a unit under the threshold stays whole."""
    model = build_model(FORMULA_MODEL)  # on the CPU: 5 MB, and meta's initialisers would import torch._dynamo
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    persistent = sum(n for n in (total - sum(blocks), *blocks) if n < threshold)
    return 16 * total / world + whole_bytes * persistent


@pytest.fixture(scope="module")
def simulated() -> list[dict]:
    """Every simulated rank, in this process (a simulated world needs no other; each run makes and
    destroys its own default group). Peaks are compared above each measurement's baseline."""
    runs = [(REAL_RUNS[world], "tiny", world, world - 1, False) for world in REAL_RUNS]
    runs += [({**BASE, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}},
              FORMULA_MODEL, world, rank, True) for world, rank in FORMULA_RUNS]
    return measure_simulated(runs)


@pytest.mark.parametrize("world", sorted(REAL_RUNS))
def test_simulated_rank_matches_a_real_one(dist_pool, simulated, world) -> None:
    real = dist_pool(world).run(measure_real, REAL_RUNS[world], "tiny", 2, timeout=300)[world - 1]
    sim = simulated[sorted(REAL_RUNS).index(world)]
    label = f"W={world} stage {REAL_RUNS[world]['zero_optimization']['stage']}"
    assert sim["simulated"] is True and (sim["world_size"], sim["rank"]) == (world, world - 1)
    assert sim["skipped_steps"] == 0, f"{label}: the stand-in values made a step non-finite"
    for ref in real:
        assert sim["model_states_bytes"] == ref["model_states_bytes"], label
        assert sim["collectives"] == ref["collectives"], label
    peak = sim["peak_device_allocated_bytes"] - sim["device_baseline_bytes"]
    real_peaks = [ref["peak_device_allocated_bytes"] - ref["device_baseline_bytes"] for ref in real]
    real_peak = min(real_peaks)
    assert abs(peak - real_peak) <= PEAK_TOLERANCE * real_peak, f"{label}: simulated {peak} vs real {real_peaks}"


@pytest.mark.parametrize("index", range(len(FORMULA_RUNS)))
def test_stage3_states_at_scale_follow_the_formula(simulated, index) -> None:
    world, rank = FORMULA_RUNS[index]
    report = simulated[len(REAL_RUNS) + index]
    assert (report["world_size"], report["rank"], report["stage"]) == (world, rank, 3)
    expected = _formula(world, whole_bytes=4)
    total = report["model_states_bytes"]["total"]
    assert abs(total - expected) <= FORMULA_TOLERANCE * expected, (total, expected, report["model_states_bytes"])
    assert {row["group_size"] for row in report["collectives"]} == {world}  # every collective spans the world


@pytest.mark.parametrize("index", range(len(FORMULA_RUNS)))
def test_predicted_peak_at_scale_matches_the_simulated_rank(simulated, index, tmp_path) -> None:
    """Issue 39's prediction (`zeroshard explain`: one step traced on fake tensors, the engine's
    buffers replayed) against the peak this simulated rank allocated for real (the profiler's
    count) at 64 and 512 ranks. Two independent ways to the same number; 2%: the grid of
    benchmarks/memory_peak.py holds 3% at W<=4, measured 0.01% here."""
    import json

    from zeroshard.tools.explain import explain_data

    world, _rank = FORMULA_RUNS[index]
    report = simulated[len(REAL_RUNS) + index]
    raw = {**BASE, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    memory = explain_data(str(path), world, FORMULA_MODEL, seq=16, device="cpu")["memory"]
    measured = report["peak_device_allocated_bytes"] - report["device_baseline_bytes"]
    predicted = memory["device_peak_bytes"]
    assert abs(predicted - measured) <= 0.02 * measured, (world, predicted, measured)
