"""Predicted against measured per-rank peaks on 2 ranks (issue 39's goal: within 5%), and the
budget refused on every rank together.

The measurement is the CPU allocator's own count (zeroshard.memory.AllocationTracker) around a
real second training step; the prediction is `predict_step` for the CPU (docs/memory.md). The
cells are a pooled sample of benchmarks/memory_peak.py's grid (stages 0-3 x offload x activation
checkpointing x AdamW/Muon x W 1, 2, 4: 96 cells, every one within 5%; the table is in
docs/memory.md): every stage (stage 3 gathering every unit), every offload, both
checkpointing settings, both optimizers. tests/unit/memory/test_trace.py checks the trace of the
model alone against the allocator.
"""

import pytest

from benchmarks.memory_peak import Cell, run_cells

# Issue 39's goal. Measured misses on the grid: 2.7% at most (kernels' workspaces, below).
TOLERANCE = 0.05
CELLS = [
    Cell(0, "none", False, "muon"),
    Cell(1, "optimizer", True, "muon"),
    Cell(2, "optimizer", False, "adamw"),
    Cell(3, "none", False, "adamw"),
    Cell(3, "optimizer+params", True, "adamw"),
]


def grid_task() -> list[tuple[str, float, int, int]]:
    return [(r["name"], r["ratio"], r["measured"]["peak"], r["predicted"]["peak"]) for r in run_cells(CELLS)]


def test_predicted_peaks_within_five_percent_of_the_allocator(dist_pool):
    results = dist_pool(2).run(grid_task, timeout=600)
    for rank, rows in enumerate(results):
        assert len(rows) == len(CELLS)
        for name, ratio, measured, predicted in rows:
            assert abs(ratio - 1) <= TOLERANCE, f"rank {rank}, {name}: predicted {predicted}, measured {measured}"


def budget_task(budget_gb: float | None) -> dict:
    import torch

    import zeroshard
    from zeroshard.memory.budget import MemoryBudgetError
    from zeroshard.models import build_gpt

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "steps_per_print": 10**9,
              "zeroshard": {"memory_budget_gb": budget_gb}}
    try:
        engine, *_ = zeroshard.initialize(model=build_gpt("tiny"), config=config)
        x = torch.randint(0, 256, (4, 64))
        engine.backward(engine(x, x)[1])
        engine.step()
    except MemoryBudgetError as exc:
        return {"refused": str(exc)}
    prediction = engine.memory_guard.prediction
    return {"refused": None, "predicted": None if prediction is None else prediction.device_peak_bytes}


@pytest.mark.parametrize("budget_gb, when", [(0.002, "initialize"), (0.0045, "first forward"), (None, None)])
def test_budget_is_refused_on_every_rank_naming_terms_and_knobs(dist_pool, budget_gb, when):
    # The tiny preset on 2 ranks, stage 2: states and the step about 3.6 MiB, the traced step's
    # peak about 5 MiB (benchmarks/memory_peak.py). 2 MiB refuses at initialize, 4.5 MiB at the
    # first forward (the activations do not fit), null turns the check off.
    results = dist_pool(2).run(budget_task, budget_gb, timeout=300)
    if when is None:
        assert all(r["refused"] is None and r["predicted"] is None for r in results)
        return
    messages = [r["refused"] for r in results]
    assert messages[0] is not None and messages[0] == messages[1], messages  # the same error on every rank
    message = messages[0]
    assert message.startswith(f"zeroshard.memory_budget_gb={budget_gb:g}: the predicted peak")
    assert ("before the first forward" in message) == (when == "initialize")
    assert "Largest terms:" in message and "To shrink them:" in message
    if when == "first forward":
        assert "activations" in message and "activation checkpointing" in message
    else:
        assert "optimizer_state" in message and "zero_optimization.offload_optimizer" in message
