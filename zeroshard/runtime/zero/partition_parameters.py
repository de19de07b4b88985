"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` path: `Init`, `GatheredParameters`
and `ZeroParamStatus` (zeroshard/zero/); the tensor-constructor names transformers patches
around `from_pretrained` (zeroshard/zero/constructors.py) and `get_accelerator`, which that patch
reads from this module."""

from zeroshard.launch.accelerator import get_accelerator
from zeroshard.zero import GatheredParameters, Init
from zeroshard.zero.constructors import _orig_torch_arange, zero_wrapper_for_fp_tensor_constructor
from zeroshard.zero.param_status import ZeroParamStatus

__all__ = [
    "GatheredParameters", "Init", "ZeroParamStatus", "_orig_torch_arange", "get_accelerator",
    "zero_wrapper_for_fp_tensor_constructor",
]
