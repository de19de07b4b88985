"""An AutoEP model's weights under the original Hugging Face names and layout, so `zeroshard
to-fp32` and `save_16bit_model` give a state dict the unswapped model strict-loads.

    <layer>.router.gate.weight               -> <layer>.gate.weight
    <layer>.router.e_score_correction_bias   -> <layer>.gate.e_score_correction_bias
    <layer>.experts.w1 [E, ffn, H] + w3      -> <layer>.experts.gate_up_proj [E, 2*ffn, H] (fused layout)
    <layer>.experts.w2 [E, H, ffn]           -> <layer>.experts.down_proj
    shared experts                           keep their names

or, for experts held as one module per expert (remote-code DeepSeek-V3 / Moonlight,
transformers 4's Mixtral: the layout the swap detected),

    <layer>.experts.w1 / w3 / w2 [E, ...]    -> <layer>.experts.<j>.gate_proj / up_proj / down_proj.weight

The layout of each layer (its preset's names) is recorded in the checkpoint index ("autoep"),
so a checkpoint converts without the model.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["hf_layouts", "to_hf_state_dict"]


def hf_layouts(module: nn.Module) -> dict[str, dict[str, Any]]:
    """Every AutoEP layer's name -> the Hugging Face names its parts had."""
    from zeroshard.moe.autoep.swap import autoep_layers

    out = {}
    for name, layer in autoep_layers(module):
        preset = layer.settings.preset
        out[name] = {
            "router": preset.router_pattern, "experts": preset.experts_pattern, "w1": preset.expert_w1,
            "w2": preset.expert_w2, "w3": preset.expert_w3, "bias": preset.selection_bias,
            "modules": preset.expert_modules, "weight_attr": preset.expert_weight_attr,
        }
        if preset.selection_bias_path is not None:  # the bias lives on the block or a submodule of it
            out[name]["bias_path"] = preset.selection_bias_path
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], layouts: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """`state` (the swapped model's names, global expert stacks) with every AutoEP layer's
    entries renamed and re-laid-out as the Hugging Face block had them; order kept."""
    if not layouts:
        return state
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        prefix = next((p for p in layouts if key.startswith(p + ".")), None)
        if prefix is None:
            out[key] = value
            continue
        layout, rest = layouts[prefix], key[len(prefix) + 1:]
        router, experts = f"{prefix}.{layout['router']}", f"{prefix}.{layout['experts']}"
        if rest == "router.gate.weight":
            out[f"{router}.weight"] = value
        elif rest == "router.e_score_correction_bias":
            path = layout.get("bias_path")
            owner = router if path is None else prefix if path == "" else f"{prefix}.{path}"
            out[f"{owner}.{layout['bias'] or 'e_score_correction_bias'}"] = value
        elif rest == "experts.w1" and layout.get("modules"):
            w3, w2 = state[f"{prefix}.experts.w3"], state[f"{prefix}.experts.w2"]
            out.update(_per_expert(experts, layout, value, w3, w2))
        elif rest == "experts.w1":
            w3 = state[f"{prefix}.experts.w3"]
            if layout["w3"] is None:
                out[f"{experts}.{layout['w1']}"] = torch.cat([value, w3], dim=1)
            else:
                out[f"{experts}.{layout['w1']}"] = value
                out[f"{experts}.{layout['w3']}"] = w3
        elif rest == "experts.w2":
            if not layout.get("modules"):  # else written with w1
                out[f"{experts}.{layout['w2']}"] = value
        elif rest != "experts.w3":
            out[key] = value  # shared experts and their gate: unchanged names
    return out


def _per_expert(experts: str, layout: dict[str, Any], w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor):
    """The global stacks as one module per expert, in the module's order (gate, up, down);
    each row copied, as safetensors refuses tensors that share storage."""
    suffix = f".{layout['weight_attr']}" if layout.get("weight_attr") else ""
    out = {}
    for j in range(w1.shape[0]):
        for name, stack in ((layout["w1"], w1), (layout["w3"], w3), (layout["w2"], w2)):
            out[f"{experts}.{j}.{name}{suffix}"] = stack[j].clone()
    return out
