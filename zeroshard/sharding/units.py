"""Which parameters form a unit: the wrapping policy of docs/design.md section 3.

A unit is the granularity at which gradients are reduced during backward (stages 2 and 3)
and parameters are gathered and freed (stage 3). By default each element of the model's
largest repeated block list (an `nn.ModuleList` / `nn.Sequential` of modules of one
class, e.g. the transformer blocks) is a unit and everything else forms the root unit.
`zeroshard.unit_module_classes` picks the unit modules by class name instead, and units
smaller than `zeroshard.unit_min_params` merge into the root unit. A stage-3 leaf module
(`zeroshard.utils.set_z3_leaf_modules`) is never split: no unit lies strictly inside one, and
a leaf that no unit holds becomes a unit of its own, so it is gathered as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

ROOT_UNIT_NAME = "<root>"


@dataclass
class UnitSpec:
    """A unit before its flat buffers exist: a module and the parameters it owns."""

    name: str
    module: nn.Module
    param_names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def full_numel(p: torch.Tensor) -> int:
    """The parameter's full element count, also while it is partitioned: `ds_numel` (DeepSpeed's
    name) is set on a stage-3 parameter by its flat buffer and on one built under zero.Init by
    its partitioning, while the tensor itself holds 0 elements."""
    numel = getattr(p, "ds_numel", None)
    return int(numel) if numel is not None and p.numel() == 0 else p.numel()


def _numel(module: nn.Module) -> int:
    # Full sizes, also for parameters built under zero.Init (partitioned: numel 0).
    return sum(full_numel(p) for p in module.parameters())


def _inside(name: str, outer: list[str]) -> bool:
    return any(name.startswith(o + ".") for o in outer)


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules marked as stage-3 leaves (the root itself never counts)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if name and getattr(module, "_z3_leaf", False) and not _inside(name, [n for n, _ in found]):
            found.append((name, module))
    return found


def _largest_repeated_block_list(model: nn.Module, leaves: list[str]) -> list[tuple[str, nn.Module]]:
    """The children of the container of same-class modules holding the most parameters
    (containers inside a leaf module do not count)."""
    best: list[tuple[str, nn.Module]] = []
    best_numel = 0
    for name, module in model.named_modules():
        if _inside(name, leaves) or (name in leaves):
            continue
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.named_children())
        if len(children) < 2:
            continue
        if len({type(child) for _, child in children}) != 1:
            continue
        numel = sum(_numel(child) for _, child in children)
        if numel > best_numel:
            prefix = f"{name}." if name else ""
            best = [(prefix + child_name, child) for child_name, child in children]
            best_numel = numel
    return best


def _class_matches(module: nn.Module, names: set[str]) -> bool:
    cls = type(module)
    return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names


def _modules_of_classes(model: nn.Module, names: set[str]) -> list[tuple[str, nn.Module]]:
    """Outermost modules whose class is named in `names` (a match inside a match is not split)."""
    found: list[tuple[str, nn.Module]] = []
    taken: set[str] = set()
    for name, module in model.named_modules():
        if not name or any(name.startswith(t + ".") for t in taken):
            continue
        if _class_matches(module, names):
            found.append((name, module))
            taken.add(name)
    return found


def plan_units(
    model: nn.Module,
    unit_module_classes: list[str] | None = None,
    unit_min_params: int = 0,
) -> list[UnitSpec]:
    """Split the trainable parameters of `model` into units.

    The root unit comes first, then the unit modules in model order. A parameter that
    appears under two different unit modules (tied weights) belongs to the root unit, which
    is gathered for the whole forward and backward at stage 3, so it is available wherever
    it is used.

    Returns:
        The units that own at least one trainable parameter; the root unit is always
        present (possibly empty) as element 0.
    """
    leaves = _leaf_modules(model)
    leaf_names = [n for n, _ in leaves]
    if unit_module_classes:
        candidates = _modules_of_classes(model, set(unit_module_classes))
    else:
        candidates = _largest_repeated_block_list(model, leaf_names)
    candidates = [(n, m) for n, m in candidates if not _inside(n, leaf_names)]
    held = [n for n, _ in candidates]
    extra = [(n, m) for n, m in leaves if n not in held and not _inside(n, held)]
    if extra:  # leaves no unit holds become units, in model order
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        candidates = sorted(candidates + extra, key=lambda item: order[item[0]])
    candidates = [
        (name, m) for name, m in candidates if _numel(m) >= max(unit_min_params, 1)
    ]

    # Which unit modules each parameter (by identity) appears under.
    owners: dict[int, set[int]] = {}
    for unit_index, (_, module) in enumerate(candidates):
        for p in module.parameters():
            owners.setdefault(id(p), set()).add(unit_index)

    root = UnitSpec(ROOT_UNIT_NAME, model)
    specs = [UnitSpec(name, module) for name, module in candidates]
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        unit_ids = owners.get(id(p), set())
        target = specs[next(iter(unit_ids))] if len(unit_ids) == 1 else root
        target.param_names.append(name)
        target.params.append(p)
    return [root] + [s for s in specs if s.params]
