"""DeepSpeed's tensor-constructor names in `deepspeed.runtime.zero.partition_parameters`, which
transformers patches around `from_pretrained`.

DeepSpeed's Init replaces torch's tensor constructors while it is active, each wrapped by
`zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype, target_device)` so that floating
tensors come out in Init's dtype on its device. transformers' `prevent_arange_dtype_change()`
(entered just before `zero.Init` in `from_pretrained`) swaps that wrapper, for the duration, for
one that leaves `torch.arange` alone, recognised as `_orig_torch_arange`, so RoPE's frequency
buffers keep their explicit dtype.

zeroshard's Init replaces no constructor: a tensor is made where, and in the dtype, its code
asks for, and floating parameters are cast by Init(dtype=...) or later by the engine. So Init
never calls the wrapper; the names exist for the patch to apply and be undone, and the wrapper
does what DeepSpeed's does for a caller that uses it directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["_orig_torch_arange", "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor], target_fp_dtype: torch.dtype, target_device: Any = None
) -> Callable[..., torch.Tensor]:
    """`fn` with a default device (`target_device`, else the host) and its floating results in
    `target_fp_dtype`, as DeepSpeed 0.19's function of this name."""

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = torch.device(target_device if target_device is not None else "cpu")
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point() and tensor.dtype != target_fp_dtype:
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    return wrapped
