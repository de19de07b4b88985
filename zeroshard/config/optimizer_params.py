"""The rules of the built-in optimizers' parameters (`optimizer.params` of Adam, AdamW, SGD).

One table: the config validation (zeroshard.config.schema) and `build_optimizer` both check a
config's parameters here, so nothing the one refuses is accepted by the other. Muon's rules are
in zeroshard/optim/muon/optimizer.py (`muon_param_problems`). Outside the optim package so that the config
validation can import it without torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from zeroshard.config.suggest import did_you_mean

__all__ = ["NO_EFFECT", "OPTIMIZER_PARAMS", "param_problems", "render_problems"]


def _number(low: float, high: float | None = None, *, low_open: bool = False, high_open: bool = False):
    def check(value: Any) -> str | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (value > low if low_open else value >= low)
        ok = ok and (high is None or (value < high if high_open else value <= high))
        if ok:
            return None
        lower = f"> {low}" if low_open else f">= {low}"
        upper = "" if high is None else (f" and < {high}" if high_open else f" and <= {high}")
        return f"must be a number {lower}{upper}, written without quotes"
    return check


def _flag(value: Any) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _betas(value: Any) -> str | None:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in value))
    return None if ok else "must be a list of two numbers in [0, 1), e.g. [0.9, 0.999]"


def _must_be_true(value: Any) -> str | None:
    if value is True:
        return None
    return "not supported by zeroshard (torch's Adam always corrects bias); remove the key"


_ADAM: dict[str, Callable[[Any], str | None]] = {
    "lr": _number(0.0),
    "betas": _betas,
    "eps": _number(0.0, low_open=True),
    "weight_decay": _number(0.0),
    "amsgrad": _flag,
    "adam_w_mode": _flag,
    "bias_correction": _must_be_true,
    "torch_adam": _flag,
    "fused": _flag,
}
_SGD: dict[str, Callable[[Any], str | None]] = {
    "lr": _number(0.0),
    "momentum": _number(0.0),
    "dampening": _number(0.0),
    "weight_decay": _number(0.0),
    "nesterov": _flag,
    "maximize": _flag,
}
# DeepSpeed's optimizer names (lower case) and the rule of each parameter they take.
OPTIMIZER_PARAMS: dict[str, dict[str, Callable[[Any], str | None]]] = {"adam": _ADAM, "adamw": _ADAM, "sgd": _SGD}
# Implementation choices that change no result.
NO_EFFECT = frozenset({"torch_adam", "fused"})


def param_problems(opt_type: str, params: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    """Every problem of a built-in optimizer's parameters.

    Returns:
        ``(kind, key, value, rule)`` tuples, kind "unknown" (rule: the allowed keys) or "value".
    """
    kind = opt_type.lower()
    rules = OPTIMIZER_PARAMS[kind]
    problems: list[tuple[str, str, Any, str]] = []
    for key, value in params.items():
        if key not in rules:
            problems.append(("unknown", key, value, ", ".join(sorted(rules))))
            continue
        rule = rules[key](value)
        if rule is not None:
            problems.append(("value", key, value, rule))
    if kind == "adamw" and params.get("adam_w_mode", True) is False:
        problems.append(("value", "adam_w_mode", False, "contradicts type AdamW; use type Adam"))
    if kind == "sgd" and params.get("nesterov") is True and not (
        isinstance(params.get("momentum"), (int, float)) and params.get("momentum", 0) > 0
        and params.get("dampening", 0) == 0
    ):
        problems.append(("value", "nesterov", True, "needs momentum > 0 and dampening 0 (torch's rule)"))
    return problems


def render_problems(opt_type: str, params: dict[str, Any]) -> list[str]:
    """`param_problems` as config messages (`optimizer.params.<key>=<value>: <rule>. <fix>`)."""
    out = []
    for kind, key, value, rule in param_problems(opt_type, params):
        if kind == "unknown":
            hint = did_you_mean(key, rule.split(", "))  # rule: the allowed keys, joined
            out.append(f"optimizer.params.{key}: unknown parameter of {opt_type}.{hint}")
        else:
            try:
                shown = json.dumps(value)
            except (TypeError, ValueError):
                shown = repr(value)
            out.append(f"optimizer.params.{key}={shown}: {rule}.")
    return out
