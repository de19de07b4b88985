"""The `qk_clip` key of a Muon config's `optimizer.params`: validation and resolved values."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.suggest import did_you_mean

QK_CLIP_KEYS = ("enabled", "threshold", "alpha")
DEFAULT_THRESHOLD = 100.0  # Kimi K2's tau
DEFAULT_ALPHA = 0.5  # the square-root split between query and key


@dataclass(frozen=True)
class QKClipSettings:
    """MuonClip: after each step, heads whose largest pre-softmax logit exceeded `threshold`
    get their query weights scaled by gamma**alpha and key weights by gamma**(1 - alpha),
    gamma = threshold / S_max (see qk_clip/__init__.py)."""

    enabled: bool = False
    threshold: float = DEFAULT_THRESHOLD
    alpha: float = DEFAULT_ALPHA


def qk_clip_problems(value: Any) -> list[str]:
    """Every problem of `optimizer.params.qk_clip`, each naming its key and the fix."""
    where = "optimizer.params.qk_clip"
    if not isinstance(value, Mapping):
        return [f'{where}={value!r}: must be an object, e.g. {{"enabled": true, "threshold": 100.0, "alpha": 0.5}}.']
    problems = []
    for key in value:
        if key not in QK_CLIP_KEYS:
            hint = did_you_mean(key, QK_CLIP_KEYS, known="Known keys")
            problems.append(f"{where}.{key}: unknown key.{hint}")
    enabled = value.get("enabled", False)
    if not isinstance(enabled, bool):
        problems.append(f"{where}.enabled={enabled!r}: must be true or false.")
    threshold = value.get("threshold", DEFAULT_THRESHOLD)
    if not _finite(threshold) or threshold <= 0:
        problems.append(
            f"{where}.threshold={threshold!r}: must be a number > 0 (the largest pre-softmax logit a head "
            "may keep; Kimi K2 uses 100)."
        )
    alpha = value.get("alpha", DEFAULT_ALPHA)
    if not _finite(alpha) or not 0.0 <= alpha <= 1.0:
        problems.append(
            f"{where}.alpha={alpha!r}: must be a number in [0, 1] (the query's share of the correction; "
            "0.5 scales query and key by the same square root)."
        )
    return problems


def parse_qk_clip(value: Any) -> QKClipSettings:
    """`optimizer.params.qk_clip` resolved (absent: disabled).

    Raises:
        ValueError: every problem at once.
    """
    if value is None:
        return QKClipSettings()
    problems = qk_clip_problems(value)
    if problems:
        raise ValueError("invalid Muon optimizer config:\n  " + "\n  ".join(problems))
    return QKClipSettings(
        enabled=bool(value.get("enabled", False)),
        threshold=float(value.get("threshold", DEFAULT_THRESHOLD)),
        alpha=float(value.get("alpha", DEFAULT_ALPHA)),
    )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
