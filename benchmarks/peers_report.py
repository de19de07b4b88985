"""Summarise peer-benchmark runs: medians over repeats, ratios, the table, the JSON and the chart.

The headline numbers are ratios within one precision mode of one invocation: a run's median step
time over the compute floor's, over DDP's, and over the fastest peer's (DDP, FSDP2, DeepSpeed).
Absolute times depend on the machine and its load and are context only.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PEER_ENGINES = ("ddp", "fsdp2", "deepspeed")
MIB = 1024 * 1024


def label(engine: str, stage: int | None, reshard: bool | None) -> str:
    """Short row name: 'zeroshard s2', 'fsdp2 reshard', 'deepspeed s1', 'ddp', 'floor'."""
    if engine in ("zeroshard", "deepspeed"):
        return f"{engine} s{stage}"
    if engine == "fsdp2":
        return "fsdp2 reshard" if reshard else "fsdp2 keep"
    return engine


def summarise(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: medians over its repeats, plus the ratios within its mode.

    Args:
        cells: dicts with keys label, engine, mode, status ("ok", "failed", "not run"),
            reason, and results (one worker JSON per successful repeat).
    """
    rows = []
    for cell in cells:
        row = {k: cell[k] for k in ("label", "engine", "mode", "stage", "reshard", "status", "reason")}
        results = cell.get("results") or []
        if results:
            row.update(_medians(results))
            row["status"] = "ok"
        rows.append(row)
    for mode in {r["mode"] for r in rows}:
        in_mode = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        floor = next((r for r in in_mode if r["engine"] == "floor"), None)
        floor_par = next((r for r in in_mode if r["engine"] == "floor-par"), None)
        ddp = next((r for r in in_mode if r["engine"] == "ddp"), None)
        peers = [r for r in in_mode if r["engine"] in PEER_ENGINES]
        fastest = min(peers, key=lambda r: r["median_step_s"]) if peers else None
        for r in in_mode:
            cpu, floor_cpu = r.get("median_cpu_s"), floor.get("median_cpu_s") if floor else None
            r["cpu_x_floor"] = cpu / floor_cpu if cpu and floor_cpu else None
            t = r["median_step_s"]
            r["x_floor"] = t / floor["median_step_s"] if floor else None
            r["x_floor_par"] = t / floor_par["median_step_s"] if floor_par else None
            r["x_ddp"] = t / ddp["median_step_s"] if ddp else None
            r["x_fastest_peer"] = t / fastest["median_step_s"] if fastest else None
            r["fastest_peer"] = fastest["label"] if fastest else None
    return rows


def _medians(results: list[dict[str, Any]]) -> dict[str, Any]:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    def med_rank_max(key: str) -> float:
        return statistics.median(max(p[key] for p in r["per_rank"]) for r in results)

    def gpu(key: str) -> float | None:  # --device cuda runs only
        return med_rank_max(key) if all(key in r["per_rank"][0] for r in results) else None

    first = results[0]
    return {
        "repeats": len(results),
        "median_step_s": med("median_step_s"),
        "step_s_per_repeat": [r["median_step_s"] for r in results],
        # Older runs have no CPU time: the median of those that do.
        "median_cpu_s": statistics.median(cpu) if (cpu := [r["median_cpu_s"] for r in results
                                                              if "median_cpu_s" in r]) else None,
        "tokens_per_s": med("tokens_per_s"),
        "phase_median_s": {
            k: statistics.median(r["rank0_phase_median_s"][k] for r in results)
            for k in ("forward", "backward", "step")
        },
        "model_state_bytes": med_rank_max("model_state_bytes"),
        "model_states_by_role_rank0": first["per_rank"][0]["model_states"],
        "live_tensor_bytes": med_rank_max("live_tensor_bytes"),
        "peak_rss_bytes": med_rank_max("peak_rss_bytes"),
        "rss_over_baseline_bytes": statistics.median(
            max(p["peak_rss_bytes"] - p["baseline_rss_bytes"] for p in r["per_rank"]) for r in results
        ),
        "cuda_max_memory_allocated_bytes": gpu("cuda_max_memory_allocated_bytes"),
        "cuda_max_memory_reserved_bytes": gpu("cuda_max_memory_reserved_bytes"),
        "comm_bytes_per_step": first["comm_bytes_per_step"],
        "comm_total_bytes_per_step": first["comm_total_bytes_per_step"],
        "comm_wire_bytes_per_rank": first["comm_wire_bytes_per_rank"],
        "comm_source": first["comm_source"],
        "final_loss": first["final_loss"],
        "final_loss_per_repeat": [r["final_loss"] for r in results],
        "num_params": first["workload"]["num_params"],
        "estimate_model_state_bytes": first.get("estimate_model_state_bytes"),
        "comm_theory_bytes_per_step": first.get("comm_theory_bytes_per_step"),
    }


def _fmt_ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.0f}"


def _fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _on_gpu(rows: list[dict[str, Any]]) -> bool:
    return any(r.get("cuda_max_memory_allocated_bytes") is not None for r in rows)


def _fmt_gpu(r: dict[str, Any]) -> str:
    """GPU peak allocated (reserved) MiB of the rank with the largest peak."""
    if r.get("cuda_max_memory_allocated_bytes") is None:
        return ""
    return f"{r['cuda_max_memory_allocated_bytes'] / MIB:.0f} ({r['cuda_max_memory_reserved_bytes'] / MIB:.0f})"


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    """The summary table on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (
        ("mode", "left"), ("engine", "left"), ("step ms", "right"), ("CPU ms", "right"), ("tok/s", "right"),
        ("x floor", "right"), ("x floor-par", "right"), ("x DDP", "right"), ("x fastest peer", "right"),
        ("states MiB", "right"), ("live MiB", "right"), ("RSS MiB", "right"),
        ("comm MiB/step", "right"), ("loss", "right"),
    ) + ((("GPU peak MiB (reserved)", "right"),) if _on_gpu(rows) else ()):
        table.add_column(col, justify=justify)
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["mode"], r["label"], f"[dim]{r['status']}: {r['reason'][:60]}[/dim]")
            continue
        table.add_row(
            r["mode"], r["label"], f"{r['median_step_s'] * 1e3:.1f}", _fmt_ms(r.get("median_cpu_s")),
            f"{r['tokens_per_s']:.0f}",
            *(_fmt_ratio(r[k]) for k in ("x_floor", "x_floor_par", "x_ddp", "x_fastest_peer")),
            f"{r['model_state_bytes'] / MIB:.2f}", f"{r['live_tensor_bytes'] / MIB:.2f}",
            f"{r['peak_rss_bytes'] / MIB:.0f}", f"{r['comm_total_bytes_per_step'] / MIB:.2f}",
            f"{r['final_loss']:.4f}", *((_fmt_gpu(r),) if _on_gpu(rows) else ()),
        )
    Console(width=200).print(table)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The same table as Markdown, for docs/benchmarks.md."""
    gpu = _on_gpu(rows)
    head = (
        "| mode | engine | step ms | × floor | × floor-par | × DDP | × fastest peer | CPU ms (× floor) "
        "| tok/s | model states MiB/rank | live tensors MiB | peak RSS MiB (Δ) | comm MiB/step | loss |"
        + (" GPU peak MiB (reserved) |" if gpu else "") + "\n"
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|" + ("--:|" if gpu else "") + "\n"
    )
    lines = []
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['mode']} | {r['label']} | {r['status']}: {r['reason']} |||||||||||||")
            continue
        theory = r["engine"] not in ("zeroshard", "floor", "floor-par")
        cpu = _fmt_ms(r.get("median_cpu_s"))
        if r.get("cpu_x_floor"):
            cpu += f" ({r['cpu_x_floor']:.2f})"
        comm = f"{r['comm_total_bytes_per_step'] / MIB:.2f}" + ("*" if theory else "")
        lines.append(
            f"| {r['mode']} | {r['label']} | {r['median_step_s'] * 1e3:.1f} "
            f"| {_fmt_ratio(r['x_floor'])} | {_fmt_ratio(r['x_floor_par'])} | {_fmt_ratio(r['x_ddp'])} "
            f"| {_fmt_ratio(r['x_fastest_peer'])} | {cpu} | {r['tokens_per_s']:.0f} "
            f"| {r['model_state_bytes'] / MIB:.2f} | {r['live_tensor_bytes'] / MIB:.2f} "
            f"| {r['peak_rss_bytes'] / MIB:.0f} ({r['rss_over_baseline_bytes'] / MIB:.0f}) "
            f"| {comm} | {r['final_loss']:.4f} |" + (f" {_fmt_gpu(r)} |" if gpu else "")
        )
    return head + "\n".join(lines) + "\n"


def write_chart(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Step time and model-state memory per engine, one row of panels per precision mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in dict.fromkeys(r["mode"] for r in rows) if any(
        r["mode"] == m and r["status"] == "ok" for r in rows)]
    if not modes:
        return
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 2.6 * len(modes) + 0.6), squeeze=False)
    colors = {"floor": "#888888", "floor-par": "#bbbbbb", "zeroshard": "#1f77b4", "ddp": "#2ca02c", "fsdp2": "#ff7f0e",
              "deepspeed": "#9467bd"}
    for i, mode in enumerate(modes):
        ok = [r for r in rows if r["mode"] == mode and r["status"] == "ok"]
        names = [r["label"] for r in ok]
        color = [colors.get(r["engine"], "#333333") for r in ok]
        ax_t, ax_m = axes[i]
        ax_t.barh(names, [r["median_step_s"] * 1e3 for r in ok], color=color)
        floor = next((r for r in ok if r["engine"] == "floor"), None)
        if floor:
            ax_t.axvline(floor["median_step_s"] * 1e3, color="#444444", linestyle="--", linewidth=1)
        floor_par = next((r for r in ok if r["engine"] == "floor-par"), None)
        if floor_par:
            ax_t.axvline(floor_par["median_step_s"] * 1e3, color="#444444", linestyle=":", linewidth=1)
        ax_t.set_title(f"{mode}: median step time (ms; floor dashed, floor-par dotted)", fontsize=9)
        ax_m.barh(names, [r["model_state_bytes"] / MIB for r in ok], color=color)
        ax_m.set_title(f"{mode}: model states per rank (MiB)", fontsize=9)
        for ax in (ax_t, ax_m):
            ax.invert_yaxis()
            ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write_json(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]], cells: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows, "runs": cells}, indent=1))
