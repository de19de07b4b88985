"""Refusing a config that cannot fit, before it runs out (docs/memory.md, "Refused before it runs out").

The budget is `zeroshard.memory_budget_gb` (GiB, 2^30 bytes, DeepSpeed's "GB") when the config
sets it, on any device; otherwise, on an accelerator, the device's memory; `null` turns the
check off (and so does leaving it unset on the CPU). The prediction (plan.py) that exceeds it is
refused with the largest terms and the knobs that shrink each of them.
"""

from __future__ import annotations

import torch

from zeroshard.config.error import ConfigError
from zeroshard.config.schema import ZeroshardConfig

__all__ = ["GIB", "MemoryBudgetError", "budget_bytes", "human_bytes", "refusal"]

GIB = 2**30
KEY = "zeroshard.memory_budget_gb"

def knob(name: str, config: ZeroshardConfig) -> str | None:
    """What shrinks the part `name` of the peak, from where the config stands (docs/memory.md)."""
    zero = config.zero_optimization
    stage, offloaded = zero.stage, zero.optimizer_offload
    if name == "activations":
        return ("activation checkpointing (torch.utils.checkpoint per block; `zeroshard explain "
                "--activation-checkpointing` shows what it leaves), or a smaller train_micro_batch_size_per_gpu or "
                "sequence (activations grow with both)")
    if name in ("optimizer_state", "master_weights", "optimizer_step"):
        if stage == 0:
            return "zero_optimization.stage 1 or more (sharded over the ranks)"
        return "more ranks (they are sharded 1/W)" if offloaded else \
            "zero_optimization.offload_optimizer (to the host), or more ranks (sharded 1/W)"
    if name == "params":
        if stage < 3:
            return "zero_optimization.stage 3 (sharded over the ranks)"
        return "more ranks (sharded 1/W)" if zero.param_offload else "zero_optimization.offload_param (to the host)"
    if name == "gradients":
        if stage < 2:
            return "zero_optimization.stage 2 or 3 (only the shard is kept)"
        return "data_types.grad_accum_dtype bf16 (half the bytes, a lossy choice), or more ranks"
    return {
        "reduce_buckets": "a smaller zero_optimization.reduce_bucket_size",
        "gathered_units": "a smaller zero_optimization.stage3_prefetch_bucket_size or stage3_max_live_parameters",
        "gather_buffers": "a smaller zero_optimization.stage3_prefetch_bucket_size",
        "publish_buckets": "a smaller zero_optimization.allgather_bucket_size",
        "expert_exchange": "a smaller capacity_factor, or a larger ep_size",
        "sequence_exchange": "a larger sequence_parallel_size",
    }.get(name)


class MemoryBudgetError(ConfigError):
    """The predicted peak does not fit the memory budget (a ConfigError: the config is the cause)."""


def budget_bytes(config: ZeroshardConfig, device: torch.device) -> tuple[int | None, str]:
    """(the budget in bytes, where it comes from), or (None, why) when the check is off."""
    extras = config.zeroshard
    if "memory_budget_gb" in extras.model_fields_set:
        if extras.memory_budget_gb is None:
            return None, f"{KEY} is null"
        return int(extras.memory_budget_gb * GIB), f"{KEY}={extras.memory_budget_gb:g}"
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"the memory of {torch.cuda.get_device_name(device)} ({total / GIB:.2f} GiB)"
    return None, f"{KEY} is not set (on the CPU the check runs only with a budget)"


def human_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (2.50 MiB)."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def refusal(config: ZeroshardConfig, peak: int, rank: int, phase: str, parts: dict[str, int], budget: int,
            source: str, what: str = "") -> MemoryBudgetError:
    """The error naming the largest terms of the peak and the knobs that shrink them."""
    largest = sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1])[:3]
    terms = ", ".join(f"{name} {human_bytes(value)}" for name, value in largest)
    knobs = "; ".join(f"{name}: {knob(name, config)}" for name, _ in largest if knob(name, config))
    value = source.partition("=")[2] if source.startswith(KEY) else None
    head = f"{KEY}={value}" if value is not None else f"{KEY} (unset: {source})"
    return MemoryBudgetError(
        f"{head}: the predicted peak{what} on rank {rank} is {human_bytes(peak)} (in {phase or 'the step'}), above the "
        f"budget of {human_bytes(budget)}. Largest terms: {terms}. To shrink them: {knobs}. Or raise {KEY} "
        f"(null turns the check off)."
    )
