"""``zeroshard.fp8``: fp8 compute for large Linear layers through torchao's float8 training
(docs/precision.md, "FP8 compute"). The rules across sections (bf16 only, not with fp16 or
torch_autocast) are the precision plan's (zeroshard/precision/plan.py); which Linears compute
in fp8 is decided per model (zeroshard/precision/fp8.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from zeroshard.config.base import JsonInt, _Section

FP8_RECIPES = ("tensorwise", "rowwise")


class Fp8Config(_Section):
    """``zeroshard.fp8``.

    Attributes:
        enabled: compute the large ``torch.nn.Linear`` layers in fp8 (e4m3 forward operands)
            on top of bf16 parameters and fp32 master weights.
        recipe: torchao's scaling recipe: "tensorwise" (one scale per tensor; stage 3 gathers
            these weights in fp8) or "rowwise" (one scale per row, powers of two; stage 3
            gathers them in bf16, as torchao's FSDP2 path does).
        min_features: a Linear computes in fp8 only when both its in_features and
            out_features are at least this (smaller matmuls lose more to the casts than fp8
            gains).
        emulate: run torchao's emulation (fp8 values, fp32 matmuls) instead of the fp8
            tensor cores; needed on a CPU or a GPU without fp8 support, slow.
        exclude_modules: module names (fnmatch patterns, e.g. "lm_head", "blocks.0.*") that
            stay bf16 whatever their size.
    """

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    min_features: JsonInt = Field(1024, ge=1)
    emulate: bool = False
    exclude_modules: list[str] = Field(default_factory=list)
