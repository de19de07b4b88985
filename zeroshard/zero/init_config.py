"""The config `zeroshard.zero.Init` reads, as the Hugging Face integration hands it over.

transformers' `from_pretrained` under ZeRO-3 enters `deepspeed.zero.Init(config_dict_or_path=
deepspeed_config())` while it builds the model. With the Trainer, that config still holds
`"auto"` values then: `trainer_config_finalize` fills `zero_optimization.reduce_bucket_size`,
`stage3_prefetch_bucket_size` and `stage3_param_persistence_threshold` only later, from the built
model's hidden size, before `initialize`. DeepSpeed's Init parses its config leniently (an "auto"
value falls back to the default), and Init itself needs only the stage, so here every "auto"
value is dropped before the config is resolved. `initialize` still refuses any "auto" left: by
then the integration has had its chance to fill it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zeroshard.config.file import read_config_file

__all__ = ["without_placeholders"]

PLACEHOLDER = "auto"


def without_placeholders(raw: dict | str | os.PathLike) -> dict[str, Any]:
    """`raw` (a dict or a JSON/HJSON path) as a dict with every `"auto"` value left out."""
    data = read_config_file(Path(raw)) if isinstance(raw, (str, os.PathLike)) else raw
    return _drop(data)


def _drop(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop(v) for k, v in value.items() if not (isinstance(v, str) and v == PLACEHOLDER)}
    if isinstance(value, list):
        return [_drop(v) for v in value]
    return value
