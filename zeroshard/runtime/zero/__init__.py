"""DeepSpeed's `deepspeed.runtime.zero` path: the ZeRO-3 construction and gathering contexts and
`ZeroParamStatus` (zeroshard/zero/)."""

from zeroshard.runtime.zero import partition_parameters
from zeroshard.zero import GatheredParameters, Init
from zeroshard.zero.param_status import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "partition_parameters"]
