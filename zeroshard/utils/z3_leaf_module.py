"""DeepSpeed's `deepspeed.utils.z3_leaf_module` path: re-exports of `zeroshard.zero.leaf_modules`."""

from zeroshard.zero.leaf_modules import (
    apply_leaf_module_config,
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)

__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
