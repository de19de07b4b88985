"""The forward's autocast context: the config always wins inside the engine's forward.

In torch_autocast mode the engine enters `torch.autocast` itself. In every other mode an
outer `torch.autocast` the user opened is switched off inside the engine's forward, with a
warning once per engine (each engine passes its own `warned` set: a second engine in the same
process has a config of its own, so it says so too), because following it would silently
change the compute dtype and (for the safe modules' reduce dtype) double the bytes on the wire
relative to what the plan says.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from zeroshard.precision.plan import PrecisionPlan, dtype_name


def _warn_once(warned: set[str], key: str, message: str) -> None:
    if key not in warned:
        warned.add(key)
        warnings.warn(message, stacklevel=4)


def forward_context(
    plan: PrecisionPlan, device_type: str, warned: set[str] | None = None
) -> contextlib.AbstractContextManager:
    """The context the engine's forward runs in.

    Args:
        plan: the engine's precision plan.
        device_type: "cuda" or "cpu".
        warned: the engine's record of the warnings it already gave (None: warn every time).
    """
    warned = set() if warned is None else warned
    outer = torch.is_autocast_enabled(device_type)
    if plan.autocast_dtype is not None:  # torch_autocast mode, or bf16 with torch_autocast
        if outer and torch.get_autocast_dtype(device_type) != plan.autocast_dtype:
            _warn_once(
                warned,
                "dtype",
                f"zeroshard: an outer torch.autocast({torch.get_autocast_dtype(device_type)}) is "
                f"active; the engine's forward uses the config's torch_autocast.dtype="
                f"{dtype_name(plan.autocast_dtype)} instead.",
            )
        return torch.autocast(device_type, dtype=plan.autocast_dtype)
    if outer:
        _warn_once(
            warned,
            "off",
            "zeroshard: an outer torch.autocast is active but the config's torch_autocast section "
            "is off, so the engine's forward runs without it. To compute under autocast, set "
            '"torch_autocast": {"enabled": true, "dtype": "bfloat16"} in the config.',
        )
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()
