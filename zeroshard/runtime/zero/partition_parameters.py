"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters` path: `Init`, `GatheredParameters`
and `ZeroParamStatus` (zeroshard/zero/)."""

from zeroshard.zero import GatheredParameters, Init
from zeroshard.zero.param_status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus"]
