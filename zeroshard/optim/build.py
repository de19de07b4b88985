"""Build the optimizer from the config, or re-point a user's optimizer at the master tensors.

The engine's optimizer always steps on flat master tensors (one per flat buffer), never on
the module's parameters. The parameter-group structure the user asked for is kept: each
flat buffer holds parameters of exactly one optimizer group.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .state_dtype_adamw import StateDtypeAdamW

# DeepSpeed's optimizer names and the keys each accepts (DeepSpeed 0.19 semantics).
# "Adam" is decoupled-weight-decay Adam unless `adam_w_mode` is false, as in DeepSpeed.
_ADAM_KEYS = {"lr", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode",
              "bias_correction", "torch_adam", "fused"}
_SUPPORTED: dict[str, set[str]] = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
}
_NO_EFFECT = {"torch_adam", "fused"}  # implementation choices that change no result


def _unknown_key_error(kind: str, key: str, allowed: set[str]) -> ValueError:
    close = difflib.get_close_matches(key, sorted(allowed), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else f" Allowed: {', '.join(sorted(allowed))}."
    return ValueError(f"optimizer.params.{key}: unknown key for optimizer type {kind!r}.{hint}")


def build_optimizer(
    opt_type: str,
    params: dict[str, Any],
    groups: list[dict[str, Any]],
    state_dtype: torch.dtype | None = None,
) -> torch.optim.Optimizer:
    """A torch optimizer of DeepSpeed type `opt_type` over `groups` (dicts with "params").

    `state_dtype`: the optimizer-state dtype the precision plan asks for when it differs
    from the master weights' dtype (bf16 masters with fp32 state); None when they agree.

    Raises:
        ValueError: an unsupported type or parameter, naming the config key.
    """
    kind = opt_type.lower()
    if kind not in _SUPPORTED:
        raise ValueError(
            f"optimizer.type={opt_type!r}: not supported by zeroshard. "
            f"Use one of Adam, AdamW, SGD or Muon (the engine builds Muon itself)."
        )
    for key in params:
        if key not in _SUPPORTED[kind]:
            raise _unknown_key_error(opt_type, key, _SUPPORTED[kind])
    kw = {k: v for k, v in params.items() if k not in _NO_EFFECT}
    if kind in ("adam", "adamw"):
        if kw.pop("bias_correction", True) is not True:
            raise ValueError(
                "optimizer.params.bias_correction=false: not supported by zeroshard "
                "(torch's Adam always corrects bias). Remove the key."
            )
        adam_w = kw.pop("adam_w_mode", True)
        if kind == "adamw" and adam_w is not True:
            raise ValueError("optimizer.params.adam_w_mode=false contradicts type AdamW: use type Adam.")
        kw.setdefault("lr", 1e-3)
        kw.setdefault("weight_decay", 0.0)  # DeepSpeed's FusedAdam default, not torch's 0.01
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        if state_dtype is not None:
            if kw.pop("amsgrad", False):
                raise ValueError(
                    "optimizer.params.amsgrad=true: not supported with optimizer state in a dtype "
                    "other than the master weights' (bf16.bf16_master_weights_and_grads without "
                    "bf16_optimizer_states). Drop amsgrad, or set bf16.bf16_optimizer_states=true."
                )
            return StateDtypeAdamW(groups, decoupled=adam_w, state_dtype=state_dtype, **kw)
        cls = torch.optim.AdamW if adam_w else torch.optim.Adam
        return cls(groups, **kw)
    if state_dtype is not None:
        raise ValueError(
            "optimizer.type=SGD: its momentum is kept in the master weights' dtype, but the plan asks "
            "for optimizer state in another dtype (bf16.bf16_master_weights_and_grads without "
            "bf16_optimizer_states). Set bf16.bf16_optimizer_states=true, or use Adam/AdamW."
        )
    kw.setdefault("lr", 1e-3)
    return torch.optim.SGD(groups, **kw)


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, master_groups: list[list[torch.Tensor]]
) -> torch.optim.Optimizer:
    """Make the user's optimizer step on the master tensors instead of the module's params.

    The optimizer object, its class, hyper-parameters and group structure stay as the user
    built them (so a scheduler bound to it keeps working); only each group's "params" list
    changes, and its (still empty) state is dropped.
    """
    if any(optimizer.state.values()):
        raise ValueError(
            "optimizer: it already has state (was it stepped?). Pass a freshly built optimizer "
            "to zeroshard.initialize; the engine rebuilds it over its master weights."
        )
    assert len(master_groups) == len(optimizer.param_groups)
    for group, masters in zip(optimizer.param_groups, master_groups, strict=False):
        group["params"] = list(masters)
    optimizer.state.clear()
    warnings.warn(
        f"zeroshard: re-pointed your {type(optimizer).__name__} at the engine's master weights "
        f"({len(master_groups)} param group(s), hyper-parameters unchanged).",
        stacklevel=3,
    )
    return optimizer


OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
