"""DeepSpeed's `deepspeed.utils.z3_leaf_module` path: re-exports of `zeroshard.zero.leaf_modules`."""

from zeroshard.zero.leaf_modules import *  # noqa: F403  (every name of its __all__)
from zeroshard.zero.leaf_modules import __all__  # noqa: F401
