"""Find a Hugging Face model's MoE blocks and replace each with an `AutoEPMoELayer`
(DeepSpeed's AutoEP, `expert_parallel` config section).

    from zeroshard.module_inject.auto_ep import replace_moe_layers
    settings, names = replace_moe_layers(model, config.expert_parallel, world_size)

`initialize` calls it when `expert_parallel.enabled` is true, before the engine builds its
flats, so expert weights go to expert flats sharded over the expert-data-parallel group.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.moe.autoep.layer import AutoEPMoELayer
from zeroshard.moe.autoep.presets import MoEPreset, RoutingSettings, resolve_routing
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
    settings = replace(settings, preset=detect_expert_layout(targets, settings, cfg))
    ep_rank = current_layout().expert_parallel_rank(cfg.autoep_size)
    recorder = _router_logits_recorder(model)
    for name, module in targets:
        # A block built under zero.Init holds only this rank's parts: make it whole (one block
        # at a time) so the experts are copied from their real values; the engine adopts the
        # kept parts (shared experts) afterwards as it does every Init parameter.
        gather_partitioned(list(module.parameters()))
        layer = AutoEPMoELayer(module, settings, cfg.autoep_size, ep_rank, name=name)
        layer.count_tokens = cfg.load_balance_coeff is not None
        if layer.count_tokens:
            layer.router.bias_to_buffer()
        layer.set_expert_kernels(cfg.use_grouped_mm, cfg.disable_triton_grouped_mm, cfg.combine_impl)
        if settings.preset.expert_modules:
            # One module per expert: the activation is each expert's (GroupedExperts reads
            # it from a stacked experts module only).
            act_fn = getattr(getattr(module, settings.preset.experts_pattern)[0], "act_fn", None)
            if act_fn is not None:
                layer.experts.act_fn = act_fn
        if recorder is not None:
            recorder(layer.router.gate, "router_logits", 0)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
    return settings, [name for name, _ in targets]


# Expert weight names (w1 = gate, w2 = down, w3 = up; w3 None: w1 holds gate and up fused),
# tried in order when the preset's names do not fit the model.
STACKED_LAYOUTS = (("gate_up_proj", "down_proj", None), ("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3"))
MODULE_LAYOUTS = (("gate_proj", "down_proj", "up_proj"), ("w1", "w2", "w3"))
_KEYS = ("expert_w1", "expert_w2", "expert_w3")


def detect_expert_layout(targets: list[tuple[str, nn.Module]], settings: RoutingSettings, cfg: Any) -> MoEPreset:
    """The preset with the experts' layout the model has: stacked tensors on the experts module
    (transformers 5) or an nn.ModuleList of one MLP per expert (remote code, transformers 4),
    and their weight names. Names the user wrote (expert_w1/w2/w3) are kept and checked; the
    preset's are kept when they fit, else the first known layout that fits every block.

    Raises:
        ValueError: the experts fit no known layout, or not the names written, or a block's
            layout differs from the first's (each message names the block and the keys).
    """
    preset = settings.preset
    written = {key: getattr(cfg, key, None) for key in _KEYS}
    found: MoEPreset | None = None
    for name, block in targets:
        layout = _block_layout(name, block, preset, written, settings.num_experts)
        if found is not None and layout != found:
            raise ValueError(
                f"expert_parallel: MoE block {name!r} lays its experts out differently from the first block "
                f"({_describe_layout(layout)} against {_describe_layout(found)}). Narrow moe_layer_pattern to "
                "blocks of one layout."
            )
        found = layout
    assert found is not None
    return found


def _block_layout(name: str, block: nn.Module, preset: MoEPreset, written: dict, num_experts: int) -> MoEPreset:
    experts = getattr(block, preset.experts_pattern)
    modules = isinstance(experts, nn.ModuleList)
    where = f"{name}.{preset.experts_pattern}"
    if modules:
        if len(experts) != num_experts:
            raise ValueError(
                f"expert_parallel.num_experts_attr={preset.num_experts_attr!r}: the model config says {num_experts} "
                f"experts, but {where} holds {len(experts)} modules. Set num_experts_attr to the config attribute "
                "holding the number of routed experts."
            )
        holder, candidates = experts[0], MODULE_LAYOUTS
        where = f"{where}.0"
    else:
        holder, candidates = experts, STACKED_LAYOUTS
    own = (preset.expert_w1, preset.expert_w2, preset.expert_w3)
    for names in (own, *candidates):
        if names[2] is None and modules:
            continue  # one module per expert with gate and up fused: no model has it
        if any(w is not None and w != n for w, n in zip(written.values(), names, strict=True)):
            continue  # the user's names win
        if all(n is None or hasattr(holder, n) for n in names):
            layout = replace(preset, expert_w1=names[0], expert_w2=names[1], expert_w3=names[2],
                             expert_modules=modules)
            return _with_weight_attr(layout, holder, where) if modules else layout
    has = ", ".join(n for n, _ in holder.named_children()) or ", ".join(n for n, _ in holder.named_parameters())
    wrote = ", ".join(f"{k}={v!r}" for k, v in written.items() if v is not None)
    kind = "one module per expert" if modules else "stacked expert tensors"
    raise ValueError(
        f"expert_parallel.{'expert_w1/expert_w2/expert_w3' if not wrote else wrote}: {where} ({type(holder).__name__}, "
        f"{kind}) has no weights named {_names(own)} nor any known layout ({', '.join(map(_names, candidates))}); "
        f"it has {has or 'nothing'}. Set expert_w1 (gate), expert_w2 (down) and expert_w3 (up; null when expert_w1 "
        "holds gate and up fused) to its names."
    )


def _with_weight_attr(layout: MoEPreset, expert: nn.Module, where: str) -> MoEPreset:
    """Per-expert weights are Linear modules (`.weight`, refused with a bias: the swapped
    experts have none) or bare parameters."""
    parts = [getattr(expert, n) for n in (layout.expert_w1, layout.expert_w2, layout.expert_w3)]
    if all(isinstance(p, nn.Module) for p in parts):
        biased = [n for n, p in zip((layout.expert_w1, layout.expert_w2, layout.expert_w3), parts, strict=True)
                  if getattr(p, "bias", None) is not None]
        if biased:
            raise ValueError(
                f"expert_parallel: {where}.{biased[0]} has a bias; AutoEP's experts have none. Leave expert_parallel "
                "off for this model."
            )
        return replace(layout, expert_weight_attr="weight")
    return replace(layout, expert_weight_attr=None)


def _names(names: tuple[str | None, ...]) -> str:
    return "/".join(n for n in names if n is not None)


def _describe_layout(layout: MoEPreset) -> str:
    kind = "one module per expert" if layout.expert_modules else "stacked"
    return f"{kind} {_names((layout.expert_w1, layout.expert_w2, layout.expert_w3))}"


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
