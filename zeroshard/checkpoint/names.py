"""The names a checkpoint keys parameters by.

A dense parameter is saved under its module name. An expert parameter is saved under its
global name, `...deepspeed_experts.<global expert index>...` (zeroshard/moe/utils.py): local
expert j is a different expert on each expert-parallel rank, and the global name is what
lets a checkpoint load onto another world size or ep_size (each rank reads the experts it
holds there). The saved set is then the ep_size = 1 model's parameter names.
"""

from __future__ import annotations

from typing import Any

from zeroshard.autotp.split import tensor_split_of
from zeroshard.moe.utils import all_global_expert_names, global_expert_names


def flat_names(engine: Any) -> list[list[str]]:
    """For each of the engine's flats, its parameters' checkpoint names."""
    experts = global_expert_names(engine.module)
    return [
        [experts.get(id(p), name) for name, p in zip(flat.names, flat.params, strict=True)]
        for flat in engine.flats
    ]


def model_param_shapes(module: Any) -> dict[str, list[int]]:
    """Every parameter's shape by checkpoint name, the experts of every expert-parallel rank
    included (all experts of a layer share one shape)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    local_experts = {name for name, p in params.items() if id(p) in global_expert_names(module)}
    # ds_shape: a stage-3 parameter outside a gather is empty (zeroshard/sharding/flat.py)
    shapes = {name: list(saved_shape(p)) for name, p in params.items() if name not in local_experts}
    for global_name, local_name in all_global_expert_names(module).items():
        shapes[global_name] = list(getattr(params[local_name], "ds_shape", params[local_name].shape))
    return shapes


def state_dict_keys(module: Any) -> list[str]:
    """`module.state_dict()`'s keys by checkpoint name: each MoE layer's local expert entries
    become every global expert's, in global order, where the first of them stood."""
    params = dict(module.named_parameters(remove_duplicate=False))
    local_to_global = global_expert_names(module)
    every_global = list(all_global_expert_names(module))
    keys: list[str] = []
    emitted: set[str] = set()
    for key in module.state_dict(keep_vars=True):
        p = params.get(key)
        if p is None or id(p) not in local_to_global:
            keys.append(key)
            continue
        layer = local_to_global[id(p)].split(".deepspeed_experts.")[0] + ".deepspeed_experts."
        if layer not in emitted:
            emitted.add(layer)
            keys.extend(name for name in every_global if name.startswith(layer))
    return keys


def saved_shape(p: Any) -> Any:
    """A parameter's shape in a checkpoint: an AutoEP stack's global [E, ...] shape (its
    `autoep_global_shape`), a tensor-parallel piece's whole shape (its `tp_split`), else the
    full shape (`ds_shape`: a stage-3 parameter outside a gather is empty,
    zeroshard/sharding/flat.py)."""
    split = tensor_split_of(p)
    if split is not None:
        return split.full_shape
    return getattr(p, "autoep_global_shape", None) or getattr(p, "ds_shape", p.shape)


def saved_offset(p: Any) -> int:
    """Where a parameter's elements start in its saved tensor: an AutoEP stack of this rank's
    experts is a contiguous block of the global stack (zeroshard/moe/autoep/layer.py);
    0 for everything else."""
    return getattr(p, "autoep_offset", 0)
