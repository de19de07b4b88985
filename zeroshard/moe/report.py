"""What `zeroshard explain` says about a model's MoE layers: the expert-parallel and expert-
data-parallel groups each ep_size gives on the world, and the expert parameters a rank holds
(the memory estimate shards those over EDP, the dense ones over the world)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.moe.utils import is_moe_param


def moe_report(model: nn.Module, world_size: int, group_of: dict[str, str]) -> tuple[dict[str, Any] | None, dict]:
    """(the report, or None without MoE layers; expert elements on a rank by EDP size, then by
    precision group). `group_of` maps parameter names to precision groups.

    Raises:
        ValueError: an ep_size that does not divide `world_size`.
    """
    from zeroshard.moe.layer import MoE

    # DeepSpeed's MoE layers and AutoEP's (zeroshard/module_inject) carry the same attributes.
    layers = [
        (name, m) for name, m in model.named_modules() if isinstance(m, MoE) or getattr(m, "_is_autoep_layer", False)
    ]
    if not layers:
        return None, {}
    expert_counts: dict[int, dict[str, int]] = {}
    sizes: dict[int, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not is_moe_param(p):
            continue
        ep_size = int(p.group_name.rsplit("_", 1)[1])
        if world_size % ep_size:
            raise ValueError(
                f"ep_size={ep_size} (MoE layers of this model): must divide the world size {world_size}."
            )
        edp = world_size // ep_size
        by_group = expert_counts.setdefault(edp, {})
        by_group[group_of[name]] = by_group.get(group_of[name], 0) + p.numel()
    for _, layer in layers:
        entry = sizes.setdefault(layer.ep_size, {
            "ep_size": layer.ep_size,
            "expert_data_parallel_size": world_size // layer.ep_size,
            "expert_parallel_groups": [list(range(i, i + layer.ep_size)) for i in range(0, world_size, layer.ep_size)],
            "expert_data_parallel_groups": [list(range(i, world_size, layer.ep_size)) for i in range(layer.ep_size)],
            "layers": 0,
            "experts_per_layer": layer.num_experts,
            "local_experts_per_layer": layer.num_local_experts,
        })
        entry["layers"] += 1
    local = sum(n for by_group in expert_counts.values() for n in by_group.values())
    report = {
        "dense_sharded_over": list(range(world_size)),
        "expert_groups": list(sizes.values()),
        "expert_params_per_rank": local,
    }
    return report, expert_counts
