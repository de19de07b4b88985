"""DeepSpeed's `deepspeed.runtime` import paths that users' scripts name.

`lr_schedules` is imported here because Accelerate reads it as an attribute of `deepspeed.runtime`
after a plain `import deepspeed` (accelerator.py `_prepare_deepspeed`:
`deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`), as DeepSpeed's own package imports it."""

from zeroshard.runtime import lr_schedules

__all__ = ["lr_schedules"]
