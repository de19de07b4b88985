"""DeepSpeed's `deepspeed.utils.tensor_fragment` path: re-exports of `zeroshard.zero.tensor_fragment`."""

from zeroshard.zero.tensor_fragment import *  # noqa: F403  (every name of its __all__)
from zeroshard.zero.tensor_fragment import __all__  # noqa: F401
