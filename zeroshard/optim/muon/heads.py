"""Presets that mark Hugging Face weights for Muon: attention heads and expert stacks.

[Note: per-head Muon presets]
With `"per_head_muon": true` (DeepSpeed's key) the attention projections of a known Hugging
Face family get the head attributes of blocks.py, read from the model's config:

    Llama, Qwen3, Qwen3-MoE, Mixtral   q_proj   num_attention_heads row blocks of head_dim
                                       k_proj, v_proj  num_key_value_heads row blocks (GQA)
                                       o_proj   num_attention_heads column blocks of head_dim
    DeepSeek-V3 (MLA)                  q_b_proj (q_proj without q_lora_rank)
                                                num_attention_heads row blocks of
                                                qk_nope_head_dim + qk_rope_head_dim
                                       kv_b_proj num_attention_heads row blocks of
                                                qk_nope_head_dim + v_head_dim (a head's key
                                                and value up-projections together, as
                                                DeepSpeed and GLM-5's "Muon split" do)
                                       o_proj   num_attention_heads column blocks of v_head_dim
                                       q_a_proj, kv_a_proj_with_mqa  whole: they project to
                                                the shared latents and the rotary key that
                                                every head reads, so they have no heads

o_proj is split only with zeroshard's `"per_head_muon_output": true`: DeepSpeed 0.19 leaves
it whole, and a DeepSpeed config must give DeepSpeed's update. A parameter that already
carries head attributes (set by the user) keeps them. A model of another family uses the
attributes directly (blocks.py).

Expert stacks. Hugging Face's `*Experts` modules (transformers 5: Mixtral, Qwen3-MoE,
DeepSeek-V3, ...) hold their experts as 3-D parameters [num_experts, rows, cols]; they are
marked `is_expert_group = True` (DeepSpeed's mark) so Muon orthogonalizes each expert on its
own, as when AutoEP swaps them in. Any other unmarked 3-D weight is one matrix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from torch import nn

from zeroshard.optim.muon.blocks import HEAD_ATTRS

__all__ = ["HEAD_PRESETS", "head_geometry", "mark_expert_stacks", "prepare_muon_marks", "tag_attention_heads"]

# leaf module name -> (heads, per-head width, axis), or None for "whole" (reported only)
Geometry = dict[str, "tuple[int, int, int] | None"]


def _standard(cfg: Any, output: bool) -> Geometry:
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    geometry: Geometry = {"q_proj": (heads, head_dim, 0), "k_proj": (kv, head_dim, 0), "v_proj": (kv, head_dim, 0)}
    geometry["o_proj"] = (heads, head_dim, 1) if output else None
    return geometry


def _mla(cfg: Any, output: bool) -> Geometry:
    heads = cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    geometry: Geometry = {
        "q_proj": (heads, qk, 0), "q_b_proj": (heads, qk, 0),
        "kv_b_proj": (heads, cfg.qk_nope_head_dim + cfg.v_head_dim, 0),
        "q_a_proj": None, "kv_a_proj_with_mqa": None,
    }
    geometry["o_proj"] = (heads, cfg.v_head_dim, 1) if output else None
    return geometry


HEAD_PRESETS: dict[str, Callable[[Any, bool], Geometry]] = {
    "llama": _standard, "qwen3": _standard, "qwen3_moe": _standard, "mixtral": _standard,
    "deepseek_v3": _mla,
}
_ATTENTION_PARAM = re.compile(r"(?:^|\.)self_attn\.(\w+)\.weight$")


def head_geometry(model_config: Any, output: bool = False) -> Geometry | None:
    """The preset's geometry for a Hugging Face config (its text config for multimodal
    models), or None for a family without a preset."""
    cfg = getattr(model_config, "text_config", None) or model_config
    preset = HEAD_PRESETS.get(getattr(cfg, "model_type", None))
    return None if preset is None else preset(cfg, output)


def _has_head_attrs(p: nn.Parameter) -> bool:
    return any(getattr(p, key, None) is not None for key in HEAD_ATTRS)


def tag_attention_heads(model: nn.Module, output: bool = False) -> dict[str, str]:
    """Set the head attributes on the attention projections of a preset family (see
    [Note: per-head Muon presets]); returns what each tagged parameter got, by name.

    Raises:
        ValueError: the model is of no preset family and no parameter carries head
            attributes; a projection's shape disagrees with its config.
    """
    geometry = head_geometry(getattr(model, "config", None), output)
    params = list(model.named_parameters())
    if geometry is None:
        if any(_has_head_attrs(p) for _, p in params):
            return {}
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        raise ValueError(
            f"per_head_muon=true, but the model (model_type={model_type!r}) is of no family with a per-head "
            f"preset ({', '.join(HEAD_PRESETS)}) and no parameter carries head attributes. Set "
            "p.muon_num_heads (rows: q, k, v) or p.muon_num_heads and p.muon_head_axis = 1 (columns: the output "
            "projection) on its attention weights, or remove per_head_muon."
        )
    tagged = {}
    for name, p in params:
        match = _ATTENTION_PARAM.search(name)
        if match is None or match.group(1) not in geometry or _has_head_attrs(p):
            continue
        spec = geometry[match.group(1)]
        if spec is None:
            continue
        heads, width, axis = spec
        shape = tuple(getattr(p, "ds_shape", p.shape)) if p.numel() == 0 else tuple(p.shape)
        if len(shape) != 2 or shape[axis] != heads * width:
            raise ValueError(
                f"per_head_muon: {name} has shape {shape}, but the model config says {heads} heads of {width} "
                f"on axis {axis} ({heads * width}). Fix the config, or set its head attributes yourself."
            )
        p.muon_num_heads, p.muon_head_dim, p.muon_head_axis = heads, width, axis
        tagged[name] = f"{heads} heads of {width} on axis {axis}"
    return tagged


def mark_expert_stacks(model: nn.Module) -> list[str]:
    """Mark the 3-D parameters of Hugging Face `*Experts` modules (`num_experts` of them,
    stacked on dim 0) as expert stacks; returns their names. An explicit mark (True or False)
    is kept."""
    marked = []
    for module_name, module in model.named_modules():
        if not type(module).__name__.endswith("Experts"):
            continue
        count = getattr(module, "num_experts", None)
        for leaf, p in module.named_parameters(recurse=False):
            shape = tuple(getattr(p, "ds_shape", p.shape)) if p.numel() == 0 else tuple(p.shape)
            if len(shape) == 3 and shape[0] == count and getattr(p, "is_expert_group", None) is None:
                p.is_expert_group = True
                marked.append(f"{module_name}.{leaf}" if module_name else leaf)
    return marked


def prepare_muon_marks(model: nn.Module, per_head: bool = False, output: bool = False) -> None:
    """Every mark Muon's layouts read (blocks.py), before the groups are split: expert stacks
    always, attention heads when `per_head`."""
    mark_expert_stacks(model)
    if per_head:
        tag_attention_heads(model, output)
