"""Memory a kernel takes inside an operator, which a trace of operator outputs cannot see.

Measured on the CPU (torch 2.13, oneDNN) with the allocator's count (tracker.py): a bf16 or fp16
matrix multiply (mm, addmm, bmm, baddbmm) accumulates into an fp32 buffer of its output's size
(plus 128 bytes of alignment) and converts at the end, so while it runs the output exists twice,
once in fp32. On the activations of a bf16 model that is as much again as the largest matmul
output, up to 5% of the tiny presets' peak when recomputation (activation checkpointing) puts
the forward's matmuls inside the backward. On CUDA, flash attention's backward accumulates the
query's gradient in fp32 (a buffer of the query's size in fp32); cuBLAS's workspace is allocated
once and left out (megabytes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["workspace_rule"]

aten = torch.ops.aten
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
_NARROW = (torch.bfloat16, torch.float16)
_ONEDNN_ALIGN = 128
# The trace runs the CPU's kernels: its flash attention backward stands for CUDA's.
_FLASH_BACKWARD = {getattr(aten, name, None) for name in (
    "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward")}


def _cpu(func: Any, args: tuple, out: Any) -> int:
    if func in _MATMULS and isinstance(out, torch.Tensor) and out.dtype in _NARROW:
        return out.numel() * 4 + _ONEDNN_ALIGN
    return 0


def _cuda(func: Any, args: tuple, out: Any) -> int:
    packet = getattr(func, "overloadpacket", None)
    if packet is not None and packet in _FLASH_BACKWARD and args and isinstance(args[1], torch.Tensor):
        return args[1].numel() * 4  # the query, in fp32
    return 0


def workspace_rule(device_type: str) -> Callable[[Any, tuple, Any], int]:
    """(func, args, out) -> bytes the kernel holds while it runs, for `device_type`."""
    return _cpu if device_type == "cpu" else _cuda
