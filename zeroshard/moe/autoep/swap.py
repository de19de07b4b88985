"""Find a Hugging Face model's MoE blocks and replace each with an `AutoEPMoELayer`
(DeepSpeed's AutoEP, `expert_parallel` config section).

    from zeroshard.module_inject.auto_ep import replace_moe_layers
    settings, names = replace_moe_layers(model, config.expert_parallel, world_size)

`initialize` calls it when `expert_parallel.enabled` is true, before the engine builds its
flats, so expert weights go to expert flats sharded over the expert-data-parallel group.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.moe.autoep.layer import AutoEPMoELayer
from zeroshard.moe.autoep.presets import RoutingSettings, resolve_routing
from zeroshard.sharding.layout import current_layout
from zeroshard.zero.init import gather_partitioned

__all__ = ["replace_moe_layers", "autoep_layers", "AutoEPMoELayer"]


def autoep_layers(model: nn.Module) -> list[tuple[str, AutoEPMoELayer]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)]


def replace_moe_layers(model: nn.Module, cfg: Any, world_size: int | None = None) -> tuple[RoutingSettings, list[str]]:
    """Swap every module whose name matches the layer pattern (and that has the router and
    experts children) for an AutoEPMoELayer holding this rank's experts.

    Returns the routing settings and the swapped modules' names.

    Raises:
        ValueError: no MoE block found, or autoep_size that the world or the experts cannot
            be split into (each message names the key and the fix).
    """
    world_size = comm.world_size() if world_size is None else world_size
    if not isinstance(cfg.autoep_size, int) or cfg.autoep_size < 1 or world_size % cfg.autoep_size:
        raise ValueError(
            f"expert_parallel.autoep_size={cfg.autoep_size}: must divide the world size {world_size} (each "
            "layer's experts are spread over autoep_size consecutive ranks). Pick a divisor of the number of ranks."
        )
    settings = resolve_routing(cfg, getattr(model, "config", None))
    preset = settings.preset
    if cfg.load_balance_coeff is not None and preset.selection_bias is None:
        raise ValueError(
            f"expert_parallel.load_balance_coeff={cfg.load_balance_coeff}: auxiliary-loss-free balancing moves the "
            f"router's selection bias, which preset {settings.preset_name!r} has none of (deepseek_v3 has). "
            "Remove load_balance_coeff."
        )
    pattern = re.compile(preset.moe_layer_pattern)
    targets = []
    for name, module in model.named_modules():
        if isinstance(module, AutoEPMoELayer):
            continue
        has_children = hasattr(module, preset.router_pattern) and hasattr(module, preset.experts_pattern)
        if has_children and pattern.fullmatch(name):
            targets.append((name, module))
    if not targets and autoep_layers(model):
        return settings, []  # swapped already (by the user, or an earlier initialize)
    if not targets:
        raise ValueError(
            f'expert_parallel.moe_layer_pattern="{preset.moe_layer_pattern}": no module of the model matches it '
            f"with children {preset.router_pattern!r} (router) and {preset.experts_pattern!r} (experts). Set "
            "preset_model, or moe_layer_pattern / router_pattern / expert_pattern to the model's names."
        )
    ep_rank = current_layout().expert_parallel_rank(cfg.autoep_size)
    recorder = _router_logits_recorder(model)
    for name, module in targets:
        # A block built under zero.Init holds only this rank's parts: make it whole (one block
        # at a time) so the experts are copied from their real values; the engine adopts the
        # kept parts (shared experts) afterwards as it does every Init parameter.
        gather_partitioned(list(module.parameters()))
        layer = AutoEPMoELayer(module, settings, cfg.autoep_size, ep_rank, name)
        layer.count_tokens = cfg.load_balance_coeff is not None
        if recorder is not None:
            recorder(layer.router.gate, "router_logits", 0)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
    return settings, [name for name, _ in targets]


def _router_logits_recorder(model: nn.Module):
    """transformers' hook installer when the model records router logits (so the swapped
    router's logits reach `output_router_logits` and the auxiliary loss); else None."""
    can_record = getattr(type(model), "_can_record_outputs", None) or {}
    if not isinstance(can_record, dict) or "router_logits" not in can_record:
        # The causal-LM head class delegates to its base model's recorders.
        base = getattr(model, "model", None)
        can_record = getattr(type(base), "_can_record_outputs", None) or {}
        if not isinstance(can_record, dict) or "router_logits" not in can_record:
            return None
    try:
        from transformers.utils.output_capturing import install_output_capuring_hook
    except ImportError:
        return None
    return install_output_capuring_hook


def apply_autoep(model: nn.Module, cfg: Any, model_parameters: Any) -> tuple[RoutingSettings, Any]:
    """The engine's entry: swap the layers, log where each routing setting came from, and
    carry `model_parameters` over to the new parameters (a list of the old model's parameters
    becomes the swapped model's trainable ones)."""
    import logging

    settings, names = replace_moe_layers(model, cfg, comm.world_size())
    if comm.rank() == 0:
        logging.getLogger("zeroshard").info(
            "AutoEP: %d MoE layer(s) swapped (%s), autoep_size %d\n  %s", len(names), ", ".join(names),
            cfg.autoep_size, "\n  ".join(settings.explain_lines()),
        )
    current = {id(p) for p in model.parameters()}
    listed = isinstance(model_parameters, (list, tuple)) and model_parameters
    if listed and isinstance(model_parameters[0], nn.Parameter):
        if any(id(p) not in current for p in model_parameters):
            # The list named the replaced blocks' weights: take the swapped model's.
            model_parameters = [p for p in model.parameters() if p.requires_grad]
    elif listed and isinstance(model_parameters[0], dict):
        if any(id(p) not in current for g in model_parameters for p in g["params"]):
            raise ValueError(
                "model_parameters: the groups name weights of the MoE blocks that expert_parallel replaces. Build "
                "the groups after initialize's swap (zeroshard.module_inject.auto_ep.replace_moe_layers), or pass "
                "model.parameters()."
            )
    return settings, model_parameters
