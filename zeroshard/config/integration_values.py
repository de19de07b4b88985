"""Values that the Hugging Face integrations write into a DeepSpeed config, which DeepSpeed
accepts and a person would rarely write (issue 24, item 3).

- `steps_per_print: Infinity`: Accelerate's DeepSpeed plugin sets it (so DeepSpeed never logs
  to stdout), and the Trainer and TRL go through that plugin. zeroshard reads it as "never print":
  `global_steps % inf` is never 0 once a step has run, which is when it is read. Other floats stay
  an error (2.5 is a typo, not a schedule).
- Top-level keys with dots, `"zero_optimization.reduce_bucket_size": ...`: TRL's
  `prepare_deepspeed` (trl/models/utils.py) writes three of them for a reference model.
  DeepSpeed reads no such key (its config ignores unknown top-level keys), so they change nothing
  there; zeroshard lists them as accepted with no effect when the dotted path names a key it knows,
  and warns, instead of calling them unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from zeroshard.config.base import _integral_float_to_int

NEVER = math.inf


def _steps_per_print(value: Any) -> Any:
    if isinstance(value, float) and value == NEVER:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # The integer's own error (and fix), not one per member of the int | float union.
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    value = _integral_float_to_int(value)
    if isinstance(value, float):
        raise ValueError(
            "must be an integer, or Infinity to never print (what Accelerate writes). Write a whole number"
        )
    if isinstance(value, int) and not isinstance(value, bool) and value < 1:
        raise ValueError("Input should be greater than or equal to 1")
    return value


StepsPerPrint = Annotated[int | float, BeforeValidator(_steps_per_print)]
"""`steps_per_print`: an integer >= 1, or Infinity (never)."""


def dotted_top_level_key(written: str, section: Any, section_of: Callable[[Any], Any]) -> bool:
    """Whether the top-level key `written` is a dotted path ("a.b.c") through `section` (the
    config model) to a key it knows, as TRL writes them; `section_of(annotation)` gives a
    field's section model or None."""
    parts = written.split(".")
    if len(parts) < 2:
        return False
    for i, part in enumerate(parts):
        if part not in section.json_keys():
            return False
        if i == len(parts) - 1:
            return True
        key = section.ALIASES.get(part) or part
        field = section.model_fields.get(key)
        section = section_of(field.annotation) if field is not None else None
        if section is None:
            return False
    return False

