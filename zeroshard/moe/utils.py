"""DeepSpeed's MoE parameter helpers (`deepspeed.moe.utils`): which parameters are expert
parameters, and optimizer groups that keep expert and dense parameters apart."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from zeroshard.sharding.layout import ParallelLayout

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "configure_moe_param_groups",
    "attach_expert_groups",
]


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` contains an MoE layer, the first one's num_experts)."""
    from zeroshard.moe.layer import MoE

    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """An expert parameter (marked `allreduce = False` by the Experts container)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """Move each group's expert parameters into groups of their own, one per expert group name
    (`ep_size_<n>`) and source group, marked `"moe": True` and named by the expert group;
    those groups are cut into pieces of at most `max_group_size` elements (None: uncut).

    `param_groups` is one group dict, or a list or tuple of them (each needs a "name"). The
    input groups lose their expert parameters; the result is those groups followed by the new
    ones, as DeepSpeed returns them.
    """
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(
            f"param_groups: a dict or a list/tuple of dicts, got {type(param_groups).__name__}."
        )
    names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    moe_groups: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for group in param_groups:
        if "name" not in group:
            raise ValueError(
                "param_groups: every group needs a 'name' to split expert parameters by (DeepSpeed's rule). "
                "Add 'name': '...' to each group."
            )
        for name in names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for by_name in moe_groups.values():
        for group in by_name.values():
            for chunk in _chunks(group["params"], max_group_size):
                param_groups.append({**group, "params": chunk})
    return param_groups


def _chunks(params: list[nn.Parameter], max_numel) -> list[list[nn.Parameter]]:
    if max_numel is None:
        return [params]
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks


def configure_moe_param_groups(model_parameters: list):
    """Optimizer groups from a parameter list or group list, split as above unless a group
    already says "moe"."""
    if not model_parameters:
        return model_parameters
    first = model_parameters[0]
    if isinstance(first, nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model_parameters), "name": "dense-params"}
        )
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters


def attach_expert_groups(model: nn.Module, layout: ParallelLayout | None = None) -> list[str]:
    """Give every MoE layer of `model` its expert-parallel groups from `layout` (the process's
    one layout when None; built collectively, in module order, so every rank builds the same
    groups in the same order); returns the expert group names in use."""
    from zeroshard.moe.layer import MoE

    names: list[str] = []
    for module in model.modules():
        if isinstance(module, MoE):
            module.set_deepspeed_parallelism(layout=layout)
            if module.expert_group_name not in names:
                names.append(module.expert_group_name)
        elif getattr(module, "_is_autoep_layer", False):  # zeroshard.module_inject.auto_ep_layer
            module.set_deepspeed_parallelism(layout=layout)
            if module.ep_group_name not in names:
                names.append(module.ep_group_name)
    return names


def global_expert_names(model: nn.Module) -> dict[int, str]:
    """id(expert parameter) -> its name with the local expert index replaced by the global
    one (`...deepspeed_experts.<ep_rank * num_local_experts + j>...`): the name that means
    the same tensor on every rank and for every ep_size (checkpoints key experts by it)."""
    from zeroshard.moe.layer import MoE

    names: dict[int, str] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        base = f"{prefix}." if prefix else ""
        for j, expert in enumerate(module.deepspeed_moe.experts.deepspeed_experts):
            g = module.global_expert_index(j)
            for name, p in expert.named_parameters():
                names[id(p)] = f"{base}deepspeed_moe.experts.deepspeed_experts.{g}.{name}"
    return names


def all_global_expert_names(model: nn.Module) -> dict[str, str]:
    """Every global expert parameter name of `model` over all expert-parallel ranks -> the
    name of this rank's local parameter of the same shape (local expert 0's)."""
    from zeroshard.moe.layer import MoE

    names: dict[str, str] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        base = f"{prefix}deepspeed_moe.experts.deepspeed_experts." if not prefix else (
            f"{prefix}.deepspeed_moe.experts.deepspeed_experts."
        )
        first = module.deepspeed_moe.experts.deepspeed_experts[0]
        for g in range(module.num_experts):
            for name, _ in first.named_parameters():
                names[f"{base}{g}.{name}"] = f"{base}0.{name}"
    return names
