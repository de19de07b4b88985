"""`zeroshard explain`'s Muon plan per optimizer group: Muon or AdamW, how the Muon matrices
are cut (whole, per head, per expert, with their block shapes), `ns_method` and the
Newton-Schulz compute dtype where the step runs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.optim.muon.groups import MuonChoice, muon_param_plan
from zeroshard.optim.muon.newton_schulz import resolve_ns_dtype
from zeroshard.optim.muon.settings import parse_muon_params
from zeroshard.precision.plan import dtype_name

__all__ = ["muon_group_report"]


def _blocks_summary(choices: list[MuonChoice]) -> dict[str, int]:
    """How the group's tensors are cut -> how many tensors are cut that way: "whole 12x6",
    "4 row heads 6x16" (q/k/v), "4 column heads 16x6" (o), "8 experts 8x16"."""
    counts: Counter[str] = Counter()
    for c in choices:
        layout = c.layout
        assert layout is not None
        shape = f"{layout.rows}x{layout.cols}"
        if layout.kind == "heads":
            key = f"{layout.count} {'row' if layout.axis == 0 else 'column'} heads {shape}"
        elif layout.kind == "experts":
            key = f"{layout.count} experts {shape}"
        else:
            key = f"whole {shape}"
        counts[key] += 1
    return dict(sorted(counts.items()))


def ns_compute_dtypes(ns_dtype: str, ns_method: str, master_dtype: torch.dtype, on_host: bool) -> dict[str, str]:
    """The Newton-Schulz compute dtype on a GPU and on the host (CPU, or optimizer offload)."""
    host = dtype_name(resolve_ns_dtype(ns_dtype, "cpu", ns_method, master_dtype))
    if on_host:
        return {"host (optimizer offload)": host}
    return {"gpu": dtype_name(resolve_ns_dtype(ns_dtype, "cuda", ns_method, master_dtype)), "cpu": host}


def muon_group_report(
    model: nn.Module, params_cfg: Mapping[str, Any] | None, master_dtype: torch.dtype = torch.float32,
    optimizer_offload: bool = False,
) -> list[dict[str, Any]]:
    """One entry per optimizer group the engine builds from the config (Muon, then AdamW)."""
    settings = parse_muon_params(params_cfg)
    choices = muon_param_plan(model, params_cfg)
    report = []
    for use_muon in (True, False):
        members = [c for c in choices if c.use_muon == use_muon]
        if not members:
            continue
        entry: dict[str, Any] = {
            "optimizer": "Muon" if use_muon else "AdamW",
            "lr": settings.muon_lr if use_muon else settings.adam_lr,
            "tensors": len(members),
            "numel": sum(int(torch.Size(c.shape).numel()) for c in members),
        }
        if use_muon:
            heads = [c for c in members if c.layout is not None and c.layout.kind == "heads"]
            entry.update({
                "per_head": settings.per_head_muon or bool(heads),
                "per_head_tensors": len(heads),
                "blocks": _blocks_summary(members),
                "ns_matrices": sum(c.layout.count for c in members if c.layout is not None),
                "ns_method": settings.ns_method,
                "ns_steps": settings.ns_steps,
                "ns_dtype": settings.ns_dtype,
                "ns_compute_dtype": ns_compute_dtypes(settings.ns_dtype, settings.ns_method, master_dtype,
                                                      optimizer_offload),
            })
        report.append(entry)
    return report
