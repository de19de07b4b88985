"""The building blocks of the config sections (zeroshard.config.sections): the report of
problems, value display, the strict JSON types and dtype names, and the _Section base model."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict


class _Report:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.no_effect: list[str] = []
        self.no_effect_changed: list[str] = []
        # Validated path -> the path as written, where they differ (aliases, legacy sections).
        self.written_as: dict[str, str] = {}


def _join(path: str, key: str | int) -> str:
    return f"{path}.{key}" if path else str(key)


def _show(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


# DeepSpeed keys whose own default is "auto" (from the model): a value there, not a placeholder.
_AUTO_IS_A_VALUE = frozenset(
    f"expert_parallel.{k}" for k in ("score_func", "top_k", "routed_scaling_factor", "score_apply", "combine_impl")
)


_AUTO_FIX = (
    '"auto" is a placeholder that the Hugging Face Trainer and Accelerate fill in before they call initialize; '
    "zeroshard does not. Pass this config to the Trainer (TrainingArguments(deepspeed=...)) or `accelerate launch` "
    "(with the `deepspeed` alias: `zeroshard install-deepspeed-alias`), or write a concrete value."
)


def _find_autos(value: Any, path: str, report: _Report) -> bool:
    """Report every "auto" inside ``value``; True if any was found."""
    found = False
    if _is_auto(value) and path in _AUTO_IS_A_VALUE:
        return False
    if _is_auto(value):
        # The whole explanation once; a Trainer config holds a dozen "auto"s.
        if any(problem.endswith(_AUTO_FIX) for problem in report.problems):
            report.problems.append(f'{path}="auto": the same placeholder (see the first "auto" above).')
        else:
            report.problems.append(f'{path}="auto": {_AUTO_FIX}')
        return True
    if isinstance(value, dict):
        for k, v in value.items():
            found |= _find_autos(v, _join(path, k), report)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found |= _find_autos(v, _join(path, i), report)
    return found


# ---------------------------------------------------------------------------------------------
# dtype names
# ---------------------------------------------------------------------------------------------

_DTYPE_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
}


def canonical_dtype_name(name: str) -> str:
    """Map any accepted dtype spelling to "fp32", "fp16" or "bf16".

    Accepts "fp32"/"float32", "fp16"/"float16"/"half", "bf16"/"bfloat16", with or without a
    "torch." prefix (DeepSpeed's own tests write ``str(torch.bfloat16)``).

    Raises:
        ValueError: for any other name.
    """
    key = str(name).strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"unknown dtype {name!r}; use one of 'fp32', 'fp16', 'bf16' "
            "(or 'float32', 'float16', 'half', 'bfloat16')"
        )
    return _DTYPE_ALIASES[key]


def _integral_float_to_int(value: Any) -> Any:
    # JSON writes 5e8 for 500000000: an integral float is an int; 2.5 and "2" stay errors.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


JsonInt = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An int field: a JSON integer or an integral float (5e8), never a string or a bool."""


def _validate_dtype_name(value: str | None) -> str | None:
    if value is None:
        return None
    canonical_dtype_name(value)
    return value


# ---------------------------------------------------------------------------------------------
# Key classes
# ---------------------------------------------------------------------------------------------


class _Unsupported(NamedTuple):
    """A recognised DeepSpeed key we do not implement.

    Attributes:
        is_inert: True for a value that asks for nothing (the feature switched off); such a
            value is accepted as "no effect".
        hint: what to do instead.
    """

    is_inert: Callable[[Any], bool]
    hint: str = "Remove it."


def _equals(*inert_values: Any) -> Callable[[Any], bool]:
    return lambda v: any(type(v) is type(i) and v == i for i in inert_values) or (
        # JSON writes 1.0 and 1 interchangeably
        isinstance(v, (int, float)) and not isinstance(v, bool)
        and any(isinstance(i, (int, float)) and not isinstance(i, bool) and v == i for i in inert_values)
    )


def _disabled_section(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and not v.get("enabled", False))


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


class _Section(BaseModel):
    """Base of every config section: unknown keys are refused (with "did you mean")."""

    # strict: "2", "1.0", "yes" and 1-for-true are errors, not coercions; frozen: the resolved
    # config is read by everyone and written by no one.
    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, frozen=True)

    # Field names that are accepted tuning knobs with no effect on any result.
    NO_EFFECT: ClassVar[frozenset[str]] = frozenset()
    # Recognised DeepSpeed keys we do not implement (not fields).
    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {}
    # Fields whose default is not worth listing among "defaults applied".
    UNLISTED_DEFAULTS: ClassVar[frozenset[str]] = frozenset()
    # DeepSpeed's other spellings of a field: alias -> field name.
    ALIASES: ClassVar[dict[str, str]] = {}

    @classmethod
    def json_keys(cls) -> list[str]:
        """Every key this section recognises, in any class."""
        return [*cls.model_fields, *cls.NOT_SUPPORTED, *cls.ALIASES]

    @classmethod
    def check_extra(cls, raw: dict[str, Any], path: str, report: _Report) -> None:
        """Section-specific checks of the raw dict (e.g. optimizer params); override."""
