"""`zeroshard explain`'s memory plan: each rank's predicted peak and its parts (zeroshard/memory/),
as the JSON's `memory.*` keys and as a table.

With a model (`--model`, `--hf-config`) the peak comes from tracing one step on fake tensors
(docs/memory.md); with `--params N` alone there is no model to trace, so the device peak is the
model states plus the buffers' bounds (tools/memory.py), activations not included, and it says so.
"""

from __future__ import annotations

from typing import Any

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.tools.memory import MemoryEstimate

__all__ = ["memory_keys", "model_spec_for", "print_memory_plan", "states_only_keys"]

CHECKPOINT_ROWS = (
    ("save_host_peak_bytes", "save (synchronous)"),
    ("async_save_host_peak_bytes", "save (asynchronous: a host copy of the share)"),
    ("consolidate_fp32_host_peak_bytes", "consolidate to fp32 (to-fp32, DeepSpeed's converters)"),
    ("consolidate_16bit_host_peak_bytes", "consolidate to 16-bit (save_16bit_model, rank 0)"),
    ("load_host_peak_bytes", "load"),
)


def model_spec_for(model: str | None, hf_config: str | None) -> Any:
    """The prediction's model (zeroshard.memory.specs) for `--model` or `--hf-config`."""
    from zeroshard.memory import factory_spec, hf_config_spec, preset_spec

    if hf_config is not None:
        return hf_config_spec(hf_config)
    assert model is not None
    return factory_spec(model) if ":" in model else preset_spec(model)


def memory_keys(
    config: ZeroshardConfig, world_size: int, spec: Any, *, seq: int | None, micro_batch: int | None,
    activation_checkpointing: bool, device: str,
) -> dict[str, Any]:
    """The JSON's memory plan keys from a traced step (`memory.device_peak_bytes`, ...)."""
    from zeroshard.memory import predict_memory

    plan = predict_memory(spec, config, world_size, micro_batch=micro_batch, seq=seq,
                          activation_checkpointing=activation_checkpointing, device_type=device)
    return plan.as_dict()


def states_only_keys(estimate: MemoryEstimate, config: ZeroshardConfig, device: str, reason: str) -> dict[str, Any]:
    """The plan's keys without a traced step: states and buffer bounds (tools/memory.py)."""
    on_cpu = device == "cpu"
    parts = dict(estimate.model_states)
    parts.update({k: v for k, v in estimate.buffers.items() if v})
    host = estimate.host_bytes
    master = estimate.model_states["master_weights"] + estimate.model_states["optimizer_state"]
    on_host = on_cpu or config.zero_optimization.optimizer_offload
    return {
        "device_peak_bytes": estimate.total_bytes + sum(estimate.host_buffers.values()) if on_cpu
        else estimate.device_bytes,
        "host_peak_bytes": host,
        "reserved_bytes": None,
        "save_host_peak_bytes": 0 if on_host else master,
        "async_save_host_peak_bytes": master,
        "consolidate_fp32_host_peak_bytes": None,
        "consolidate_16bit_host_peak_bytes": None,
        "load_host_peak_bytes": master,
        "peak_phase": None,
        "parts": parts,
        "host_parts": dict(estimate.host_buffers),
        "activations": {},
        "device": device,
        "traced": False,
        "assumptions": [reason, *estimate.assumptions],
    }


def _human(nbytes: float | None) -> str:
    if nbytes is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def print_memory_plan(console: Any, data: dict[str, Any]) -> None:
    """The plan as a table: the device peak and its parts, reserved, the host's peaks."""
    from rich.table import Table

    memory = data["memory"]
    where = "the CPU (one memory: device and host together)" if memory["device"] == "cpu" else "an accelerator"
    shape = ""
    if memory.get("traced"):
        ac = ", activation checkpointing" if memory.get("activation_checkpointing") else ""
        shape = f", micro-batch {memory['micro_batch']}, sequence {memory['seq']}{ac}"
    table = Table(title=f"Per-rank peak memory on {where} (W={data['world_size']}{shape})")
    table.add_column("at the peak" + (f" ({memory['peak_phase']})" if memory.get("peak_phase") else ""))
    table.add_column("bytes", justify="right")
    if memory.get("traced"):  # without a traced step the parts are the estimate's table above
        for key, value in memory["parts"].items():
            if value:
                table.add_row(key, _human(value))
    label = "device peak (allocated)" if memory.get("traced") else "device peak (states and buffer bounds)"
    table.add_row(f"[bold]{label}[/bold]", f"[bold]{_human(memory['device_peak_bytes'])}[/bold]")
    if memory.get("reserved_bytes") is not None:
        table.add_row("expected reserved (CUDA allocator)", _human(memory["reserved_bytes"]))
    if memory["device"] != "cpu":
        pinned = " (pinned)" if data["placement"].get("pin_memory") else ""
        table.add_row(f"[bold]host peak{pinned}[/bold]", f"[bold]{_human(memory['host_peak_bytes'])}[/bold]")
    for key, label in CHECKPOINT_ROWS:
        table.add_row(f"host, {label}", _human(memory.get(key)))
    console.print(table)
    activations = memory.get("activations") or {}
    if activations:
        console.print(
            "activations saved by the forward: "
            + ", ".join(f"{k.replace('_', ' ')} {_human(v)}" for k, v in sorted(activations.items())),
            highlight=False,
        )
    phases = memory.get("phase_peaks") or {}
    if phases:
        console.print("peak by phase: " + ", ".join(f"{k} {_human(v)}" for k, v in phases.items()), highlight=False)
    for assumption in memory.get("assumptions", []):
        console.print(f"assumed: {assumption}", highlight=False, soft_wrap=True)
