"""Rank-side scenario for tests/dist/monitor/test_monitors.py: a 2-rank run with every monitor
on, each rank writing (or not) under its own folder, returning what the loop saw."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from tests.dist.scenarios.common import Case, build_engine, case_batches, my_micro_batch

# Two steps of linear warmup, so the learning rate differs at every step.
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                            "warmup_num_steps": 3, "warmup_type": "linear"}}


def monitor_sections(root: str) -> dict[str, Any]:
    """Every monitor on, under `root` (each rank passes its own root, so a file rank 1 wrote
    would be found in rank 1's folder)."""
    return {
        "csv_monitor": {"enabled": True, "output_path": os.path.join(root, "csv"), "job_name": "job"},
        "tensorboard": {"enabled": True, "output_path": os.path.join(root, "tb"), "job_name": "job"},
        "wandb": {"enabled": True, "project": "zeroshard-test"},
        "scheduler": SCHEDULER,
    }


def run_monitored(case: Case, root: str) -> dict[str, Any]:
    """Train `case` with the monitors on; returns per step the losses this rank saw, the
    samples before and after the step, lr and loss scale after it, and engine.metrics()."""
    mine = os.path.join(root, f"rank{dist.get_rank()}")
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"
    os.environ["WANDB_DIR"] = os.path.join(mine, "wandb")
    os.makedirs(os.environ["WANDB_DIR"], exist_ok=True)
    case = Case(**{**case.__dict__, "extra": {**case.extra, **monitor_sections(mine)}})
    engine = build_engine(case)
    out: dict[str, Any] = {"losses": [], "samples_before": [], "samples_after": [], "lr": [],
                           "loss_scale": [], "metrics": [], "writes": engine.monitor.writes}
    for batch in case_batches(case):
        out["samples_before"].append(engine.global_samples)
        losses = []
        for j in range(case.ga):
            tokens, targets = my_micro_batch(batch, j, case)
            loss = engine(tokens, targets)
            engine.backward(loss)
            losses.append(float(loss))
            engine.step()
        out["losses"].append(losses)
        out["samples_after"].append(engine.global_samples)
        out["lr"].append(engine.get_lr()[0])
        out["loss_scale"].append(engine.loss_scale)
        out["metrics"].append(engine.metrics())
    engine.monitor.write_events([("Custom/my_scalar", 2.5, engine.global_samples)])
    engine.destroy()  # flushes and closes the files
    import wandb

    wandb.teardown()  # wandb keeps its settings (WANDB_DIR) per process; the next task sets its own
    return out
