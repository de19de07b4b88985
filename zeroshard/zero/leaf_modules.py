"""DeepSpeed's stage-3 leaf modules (`deepspeed.utils.set_z3_leaf_modules` and friends).

A leaf module is gathered as one at stage 3: zeroshard makes it a unit of its own (or keeps
it inside the unit that already holds it) and never splits it into smaller units, so a block
whose sub-modules run data-dependently (an MoE layer's experts: some get no tokens on some
ranks) gathers all its parameters on every rank at its forward and backward. Set leaf modules
before `initialize`: the units are planned there.
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]

_LEAF_ATTR = "_z3_leaf"  # DeepSpeed's attribute name, so a model marked either way reads the same


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is marked as a stage-3 leaf module."""
    return bool(getattr(model, _LEAF_ATTR, False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` marked as a leaf."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    setattr(model, _LEAF_ATTR, flag)


def _matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _mark(model: nn.Module, classes: list, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    if not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of classes or class names, got {classes!r}.")
    marked = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for module in marked:
        set_z3_leaf_module(module, flag)
    if not marked and raise_if_not_found:
        raise ValueError(f"no module of {classes!r} in the model; check the class names.")
    return marked


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of `model` that is an instance of one of `leaf_module_classes`
    (classes, or class names bare or dotted) as a leaf; returns them."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: list, raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Undo `set_z3_leaf_modules` for these classes."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def apply_leaf_module_config(model: nn.Module, leaf_config) -> list[nn.Module]:
    """Mark the modules ``zero_optimization.leaf_module`` names (classes, names, name suffixes)
    as leaves; initialize calls this before planning the units. Returns the modules marked."""
    marked = _mark(model, list(leaf_config.classes), True, raise_if_not_found=False)
    names, suffixes = set(leaf_config.names), tuple(leaf_config.name_suffixes)
    for name, module in model.named_modules():
        if name and (name in names or (suffixes and name.endswith(suffixes))):
            set_z3_leaf_module(module, True)
            marked.append(module)
    missing = names - {n for n, _ in model.named_modules()}
    if missing:
        raise ValueError(
            f"zero_optimization.leaf_module.names: no module named {sorted(missing)} in the model. "
            "Use the names model.named_modules() gives."
        )
    return marked
