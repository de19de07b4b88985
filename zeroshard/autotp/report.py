"""What `zeroshard explain` shows of tensor parallelism: the groups, every Linear layer's split
and the parameters each rank holds (for the per-rank memory estimate), from the plan alone (no
process group; the model may live on the meta device)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zeroshard.autotp.plan import WHOLE, plan_tensor_parallel

__all__ = ["tensor_parallel_layout", "tensor_parallel_report"]


def tensor_parallel_layout(tp_size: int, world_size: int) -> dict[str, Any]:
    """The rank groups `ParallelLayout.set_tensor_parallel` cuts (tensor innermost)."""
    return {
        "autotp_size": tp_size,
        "data_parallel_size": world_size // tp_size,
        "tensor_groups": [list(range(i, i + tp_size)) for i in range(0, world_size, tp_size)],
        "data_groups": [list(range(i, world_size, tp_size)) for i in range(tp_size)],
    }


def tensor_parallel_report(
    model: nn.Module, settings: Any, tp_size: int, world_size: int, group_of: dict[str, str]
) -> tuple[dict[str, Any], dict[str, int]]:
    """(the report, parameters each rank holds per precision group).

    Args:
        model: the unsplit model.
        settings: the config's `tensor_parallel` section.
        tp_size, world_size: the sizes.
        group_of: parameter name -> precision group (precision.plan.assign_param_groups).

    Raises:
        TensorParallelPlanError: the layers the plan cannot place, by name.
    """
    plan = plan_tensor_parallel(model, settings, tp_size)
    by_name = plan.by_name()
    layers = []
    local: dict[str, int] = {}
    for name, p in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        placement = by_name.get(owner)
        split = placement is not None and placement.kind != WHOLE and (leaf == "weight" or placement.kind == "column")
        numel = p.numel() // tp_size if split else p.numel()
        local[group_of[name]] = local.get(group_of[name], 0) + numel
    for placement in plan.placements:
        piece = list(placement.shape)
        if placement.dim is not None:
            piece[placement.dim] //= tp_size
        layers.append({
            "name": placement.name,
            "split": placement.kind,
            "rule": placement.rule,
            "shape": list(placement.shape),
            "piece": piece,
            "gather_output": placement.gather_output,
        })
    report = {
        **tensor_parallel_layout(tp_size, world_size),
        "rules": plan.source,
        "layers": layers,
        "grad_sum": list(plan.grad_sum),
        "warnings": list(plan.warnings),
    }
    return report, local
