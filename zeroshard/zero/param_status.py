"""DeepSpeed's `ZeroParamStatus` (defined in zeroshard/sharding/param_status.py, beside the flat
buffers that set a stage-3 parameter's `ds_status`)."""

from zeroshard.sharding.param_status import ZeroParamStatus

__all__ = ["ZeroParamStatus"]
