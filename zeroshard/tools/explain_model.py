"""The model `zeroshard explain` describes, built on the meta device (shapes without memory): a
preset of zeroshard.models, `module:factory`, or a Hugging Face config; and what explain reads
from it (parameters per precision group, the engine's units, Ulysses' head split)."""

from __future__ import annotations

from typing import Any

from zeroshard.config.schema import ZeroshardConfig
from zeroshard.precision.plan import PrecisionPlan, assign_param_groups

__all__ = [
    "UsageError", "attention_split", "build_model_on_meta", "hf_model_on_meta", "model_report", "preset_names",
    "unit_numels",
]


class UsageError(Exception):
    """A bad command-line argument (exit status 2)."""


def preset_names() -> list[str]:
    """Every model preset (zeroshard/models/presets.py's table)."""
    from zeroshard.models import preset_names as names

    return names()


def build_model_on_meta(spec: str) -> Any:
    """Build ``spec`` on the meta device: shapes without memory.

    Args:
        spec: a model preset (``tiny``, ``1b``, ``8b``, ``70b``, ``moonlight-16b-a3b``, ...: zeroshard.models)
            or ``module:factory``, where ``factory()`` (a function or class, called without
            arguments) returns an ``nn.Module``. The memory plan builds the same specs
            (zeroshard/memory/specs.py).

    Raises:
        UsageError: when the spec does not name a preset or an importable factory.
    """
    import torch
    from torch import nn

    from zeroshard.memory import factory_spec, preset_spec

    try:
        model_spec = factory_spec(spec) if ":" in spec else preset_spec(spec)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with torch.device("meta"):
        model = model_spec.build()
    if not isinstance(model, nn.Module):
        raise UsageError(f"--model {spec}: the factory returned {type(model).__name__}, not an nn.Module.")
    return model


def hf_model_on_meta(path: str) -> Any:
    """A Hugging Face causal LM from its config, on the meta device (for the model report)."""
    import torch

    from zeroshard.memory import hf_config_spec

    try:
        spec = hf_config_spec(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    with torch.device("meta"):
        return spec.build()


def unit_numels(model: Any, config: ZeroshardConfig) -> list[int]:
    """Element counts of the engine's units for this model (the engine's own unit rule)."""
    from zeroshard.sharding.units import plan_units

    extras = config.zeroshard
    specs = plan_units(model, extras.unit_module_classes, extras.unit_min_params)
    return [sum(p.numel() for p in spec.params) for spec in specs if spec.params]


def model_report(model: Any, plan: PrecisionPlan) -> dict[str, Any]:
    """Parameters and tensors per precision group, with their names."""
    groups = assign_param_groups(plan, model)
    params = dict(model.named_parameters())
    report: dict[str, Any] = {"num_params": sum(p.numel() for p in params.values()), "groups": {}}
    for group in plan.groups:
        names = [name for name, g in groups.items() if g == group]
        report["groups"][group] = {
            "num_params": sum(params[n].numel() for n in names),
            "num_tensors": len(names),
            "params": names,
        }
    return report


def attention_split(model: Any, sp: int) -> dict[str, Any] | None:
    """How Ulysses splits the model's attention heads over the `sp` ranks of a sequence group
    (zeroshard/sequence/layer.py head_split, DeepSpeed's uneven split) and the share of the
    whole-sequence attention activations the busiest rank holds; None when the model's config
    names no head count."""
    from zeroshard.sequence.layer import head_split

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    if not isinstance(heads, int) or heads < sp:
        return None
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    q_counts, kv_counts, _ = head_split(heads, kv_heads, sp)
    return {"heads": heads, "kv_heads": kv_heads, "query_heads_per_rank": q_counts, "kv_heads_per_rank": kv_counts,
            "busiest_fraction": max(q_counts) / heads}
