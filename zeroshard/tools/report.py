"""`zeroshard report RUN_DIR`: PNG plots of a run from its CSV monitor files.

The CSV monitor writes one file per event, DeepSpeed's way: the event name with "/" made "_"
(`Train/Samples/train_loss` -> `Train_Samples_train_loss.csv`), a header row `step,<name>` and
one `samples,value` row per write. A file with more columns is read as a table: its first
column is the x value and each other column a series named by its header. Every `.csv` under
RUN_DIR is read. Drawn, where the series exist:

    loss_lr.png      train loss and learning rate against samples seen
    step_time.png    the wall_clock_breakdown per logged interval, stacked: forward,
                     backward compute, reduction wait inside backward, optimizer step
    expert_load.png  per MoE layer a heat map of tokens per expert (rows) over the logged
                     intervals (columns)
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

__all__ = ["ReportError", "read_run", "write_report"]

Series = dict[str, list[tuple[float, float]]]

_EXPERT = re.compile(r"MoE_(?P<layer>.+)_expert(?P<expert>\d+)_tokens$")
_TIMERS = {  # stacked in this order; the reduction wait inside backward is bwd - bwd_inner
    "forward": "elapsed_time_ms_forward",
    "backward": "elapsed_time_ms_backward",
    "backward_inner": "elapsed_time_ms_backward_inner",
    "step": "elapsed_time_ms_step",
}


class ReportError(Exception):
    """RUN_DIR holds nothing to plot."""


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def read_run(run_dir: str | Path) -> Series:
    """Every series in the CSV files under `run_dir`: name -> [(x, value)] in file order.
    A two-column file's series is named by its file name (the event name, "/" as "_")."""
    series: Series = {}
    for path in sorted(Path(run_dir).rglob("*.csv")):
        with path.open(newline="") as f:
            rows = [row for row in csv.reader(f) if row]
        if len(rows) < 2:
            continue
        header, body = rows[0], rows[1:]
        names = [path.stem] if len(header) == 2 else header[1:]
        for col, name in enumerate(names, start=1):
            points = []
            for row in body:
                x, y = (_number(row[0]), _number(row[col])) if len(row) > col else (None, None)
                if x is not None and y is not None:
                    points.append((x, y))
            if points:
                series.setdefault(name, []).extend(points)
    return series


def _find(series: Series, suffix: str) -> list[tuple[float, float]] | None:
    for name in sorted(series):
        if name.endswith(suffix):
            return series[name]
    return None


def _plot_loss_lr(plt, series: Series, out: Path) -> Path | None:
    loss, lr = _find(series, "train_loss"), _find(series, "_lr")
    if not loss and not lr:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if loss:
        ax.plot(*zip(*loss, strict=True), color="tab:blue", label="train loss")
        ax.set_ylabel("train loss", color="tab:blue")
    if lr:
        ax_lr = ax.twinx()
        ax_lr.plot(*zip(*lr, strict=True), color="tab:orange", label="learning rate")
        ax_lr.set_ylabel("learning rate", color="tab:orange")
    ax.set_xlabel("samples seen")
    ax.set_title("loss and learning rate")
    ax.grid(alpha=0.3)
    return _save(plt, fig, out / "loss_lr.png")


def _plot_step_time(plt, series: Series, out: Path) -> Path | None:
    found = {key: _find(series, suffix) for key, suffix in _TIMERS.items()}
    if not all(found.values()):
        return None
    n = min(len(v) for v in found.values())
    xs = [found["forward"][i][0] for i in range(n)]
    value = {key: [v[i][1] for i in range(n)] for key, v in found.items()}
    waits = [b - i for b, i in zip(value["backward"], value["backward_inner"], strict=True)]
    parts = [
        ("forward", value["forward"]),
        ("backward compute", value["backward_inner"]),
        ("reduction wait (in backward)", waits),
        ("optimizer step", value["step"]),
    ]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    positions = list(range(n))
    bottom = [0.0] * n
    for label, heights in parts:
        ax.bar(positions, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set_xticks(positions, [f"{x:g}" for x in xs], rotation=45 if n > 8 else 0)
    ax.set_xlabel("samples seen at the end of the interval")
    ax.set_ylabel("ms per optimizer step")
    ax.set_title("step-time breakdown (wall_clock_breakdown)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, out / "step_time.png")


def _plot_expert_load(plt, series: Series, out: Path) -> Path | None:
    layers: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for name, points in series.items():
        match = _EXPERT.search(name)
        if match:
            layers.setdefault(match["layer"], {})[int(match["expert"])] = points
    if not layers:
        return None
    fig, axes = plt.subplots(len(layers), 1, figsize=(7, 1.2 + 2.2 * len(layers)), dpi=100, squeeze=False)
    for ax, (layer, experts) in zip(axes[:, 0], sorted(layers.items()), strict=True):
        n = min(len(p) for p in experts.values())
        grid = [[experts[j][i][1] if j in experts else math.nan for i in range(n)] for j in range(max(experts) + 1)]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_ylabel("expert")
        ax.set_title(f"{layer}: tokens per expert per step")
        xs = [f"{experts[min(experts)][i][0]:g}" for i in range(n)]
        ticks = list(range(0, n, max(1, n // 8)))
        ax.set_xticks(ticks, [xs[i] for i in ticks])
        fig.colorbar(image, ax=ax)
    axes[-1, 0].set_xlabel("samples seen at the end of the interval")
    return _save(plt, fig, out / "expert_load.png")


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Draw every plot the run's series allow into `out_dir` (default: `run_dir`); returns
    the PNGs written.

    Raises:
        ReportError: no CSV series under `run_dir`, or none that a plot uses.
    """
    # Imported here: matplotlib is the optional `demo` extra, and Agg needs no display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_run(run_dir)
    if not series:
        raise ReportError(f"{run_dir}: no CSV series found (a csv_monitor's output_path/job_name directory?)")
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [p for p in (
        _plot_loss_lr(plt, series, out), _plot_step_time(plt, series, out), _plot_expert_load(plt, series, out)
    ) if p is not None]
    if not written:
        raise ReportError(
            f"{run_dir}: none of its {len(series)} series is a train loss, learning rate, "
            "step-time breakdown or expert load"
        )
    return written
