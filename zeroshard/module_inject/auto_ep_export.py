"""DeepSpeed's `deepspeed.module_inject.auto_ep_export` path: re-exports of `zeroshard.moe.autoep.export`."""

from zeroshard.moe.autoep.export import (
    hf_layouts,
    to_hf_state_dict,
)

__all__ = [
    "hf_layouts",
    "to_hf_state_dict",
]
