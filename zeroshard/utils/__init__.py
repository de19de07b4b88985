"""DeepSpeed's `deepspeed.utils` import path: `from zeroshard.utils import groups`, the
tensor-fragment helpers (`safe_get_full_grad`, ...), the stage-3 leaf modules and the logger."""

from zeroshard import groups
from zeroshard.monitor.log import log_dist, logger
from zeroshard.utils import logging, zero_to_fp32
from zeroshard.zero.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
)
from zeroshard.zero.tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)

# (`z3_leaf_module` is the function here, as in DeepSpeed, not the submodule of that name.)
__all__ = [
    "groups",
    "logging",
    "zero_to_fp32",
    "logger",
    "log_dist",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
]
