"""Config keys that are known under another path: the one table the unknown-key hint consults
before guessing a spelling (zeroshard/config/suggest.py).

A key here is not a typo: the nearest spelling would send the user somewhere wrong (top-level
"gradient_accumulation_dtype" is closest to "gradient_accumulation_steps", a different
setting). Keys are written JSON paths as an unknown-key message names them; values are the path
to use instead and where the old name comes from, for the message.
"""

from __future__ import annotations

from typing import NamedTuple


class MovedKey(NamedTuple):
    to: str  # the dotted path that holds this setting
    origin: str  # where the old spelling comes from (said in the message)


MOVED_KEYS: dict[str, MovedKey] = {
    "gradient_accumulation_dtype": MovedKey("data_types.grad_accum_dtype", "the seed PR's top-level name"),
    "grad_accum_dtype": MovedKey("data_types.grad_accum_dtype", "DeepSpeed keeps it under data_types"),
    # accelerate's DeepSpeedPlugin field names, which users copy into a DeepSpeed config file.
    "zero_stage": MovedKey("zero_optimization.stage", "accelerate's DeepSpeedPlugin name"),
    "offload_optimizer_device": MovedKey(
        "zero_optimization.offload_optimizer.device", "accelerate's DeepSpeedPlugin name"
    ),
    "offload_param_device": MovedKey("zero_optimization.offload_param.device", "accelerate's DeepSpeedPlugin name"),
    "zero3_save_16bit_model": MovedKey(
        "zero_optimization.stage3_gather_16bit_weights_on_model_save", "accelerate's DeepSpeedPlugin name"
    ),
}
