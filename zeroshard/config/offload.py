"""The rules across ``zero_optimization``'s offload keys (their sections are in sections.py).

Supported: ``device`` "cpu" (or "none", off), ``pin_memory``, and ``ratio`` 1.0 (the whole
optimizer step on the host). Refused naming the key: ``device: "nvme"`` (ZeRO-Infinity) and a
``ratio`` below 1 (Offload++'s partial device step). The NVMe tuning knobs (``nvme_path``,
``buffer_count``, ``buffer_size``, ``max_in_cpu``, ``pipeline_read``/``pipeline_write``,
``fast_init``) are accepted with no effect: DeepSpeed itself reads them only for an NVMe
device, so with "cpu" they change nothing there either.
"""

from __future__ import annotations

from typing import Any


def offload_stage_problems(zero: Any) -> list[str]:
    """The offload rules across keys of ``zero_optimization`` (stage, legacy spellings)."""
    problems = []
    if zero.cpu_offload and zero.offload_optimizer is not None:
        problems.append(
            "zero_optimization.cpu_offload=true: DeepSpeed's old name for offload_optimizer, which is "
            "given too. Keep offload_optimizer only."
        )
    if zero.cpu_offload_param and zero.offload_param is not None:
        problems.append(
            "zero_optimization.cpu_offload_param=true: DeepSpeed's old name for offload_param, which is "
            "given too. Keep offload_param only."
        )
    if zero.optimizer_offload and zero.stage == 0:
        key = "offload_optimizer" if zero.offload_optimizer is not None else "cpu_offload"
        problems.append(
            f'zero_optimization.{key}: offloading the optimizer needs ZeRO stage 1, 2 or 3 (stage is 0). '
            "Set zero_optimization.stage to 1 or more, or remove it."
        )
    if zero.param_offload and zero.stage != 3:
        key = "offload_param" if zero.offload_param is not None else "cpu_offload_param"
        problems.append(
            f"zero_optimization.{key}: offloading parameters needs ZeRO stage 3 (stage is {zero.stage}). "
            "Set zero_optimization.stage to 3, or use offload_optimizer alone."
        )
    return problems
