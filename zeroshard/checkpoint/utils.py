"""DeepSpeed's `deepspeed.checkpoint.utils.clone_tensors_for_torch_save`: what Accelerate calls on
a consolidated state dict before `torch.save`, so that views of one big flat buffer are saved
as tensors of their own size (torch.save writes a view's whole storage)."""

from __future__ import annotations

from typing import Any

import torch

_HOST = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _HOST) -> Any:
    """A copy of `item` with every tensor in it (nested in lists, tuples, dicts) detached and
    copied to `device`; other values are returned as they are. Dict subclasses keep their type."""
    device = torch.device(device)
    if torch.is_tensor(item):
        return item.detach().clone() if item.device == device else item.detach().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
