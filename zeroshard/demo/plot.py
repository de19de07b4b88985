"""The demo's loss-curve PNG, drawn from the records in metrics.jsonl."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """Every record in a metrics.jsonl file (an empty list when the file does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def moving_average(values: list[float], half_width: int) -> list[float]:
    """Centred mean over values[i - half_width : i + half_width + 1], cut at the ends.

    Centred rather than trailing, so the smoothed curve does not lag the raw one.
    """
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    out = []
    for i in range(len(values)):
        lo, hi = max(0, i - half_width), min(len(values), i + half_width + 1)
        out.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return out


def write_loss_plot(records: Iterable[dict], path: str | Path, title: str = "zeroshard demo") -> Path:
    """Draw train loss (raw and smoothed) and validation loss against optimizer step.

    Args:
        records: dicts with "step" and "loss", and "val_loss" on some of them.
        path: where to write the PNG.
        title: the figure title.

    Returns:
        The path written.
    """
    # Imported here: matplotlib is the optional `demo` extra, and Agg needs no display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = list(records)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and math.isfinite(r["loss"])]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=1, label="train (per step)")
        half_width = len(losses) // 40  # about 5% of the run in each window
        ax.plot(steps, moving_average(list(losses), half_width), color="tab:blue", label="train (smoothed)")
    if val:
        steps, losses = zip(*val, strict=True)
        ax.plot(steps, losses, "o-", color="tab:orange", label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
