"""The forward's autocast context: the config always wins inside the engine's forward.

In torch_autocast mode the engine enters `torch.autocast` itself. In every other mode an
outer `torch.autocast` the user opened is switched off inside the engine's forward, with a
one-time warning, because following it would silently change the compute dtype and (for
the safe modules' reduce dtype) double the bytes on the wire relative to what the plan says.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from .precision import PrecisionPlan, dtype_name

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


def forward_context(plan: PrecisionPlan, device_type: str) -> contextlib.AbstractContextManager:
    outer = torch.is_autocast_enabled(device_type)
    if plan.mode == "torch_autocast":
        if outer and torch.get_autocast_dtype(device_type) != plan.autocast_dtype:
            _warn_once(
                "dtype",
                f"zeroshard: an outer torch.autocast({torch.get_autocast_dtype(device_type)}) is "
                f"active; the engine's forward uses the config's torch_autocast.dtype="
                f"{dtype_name(plan.autocast_dtype)} instead.",
            )
        return torch.autocast(device_type, dtype=plan.autocast_dtype)
    if outer:
        _warn_once(
            "off",
            "zeroshard: an outer torch.autocast is active but the config's torch_autocast section "
            "is off, so the engine's forward runs without it. To compute under autocast, set "
            '"torch_autocast": {"enabled": true, "dtype": "bfloat16"} in the config.',
        )
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
