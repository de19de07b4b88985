"""DeepSpeed's `deepspeed.runtime` import paths that users' scripts name."""

# Accelerate reads `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES` right after `import deepspeed`,
# without importing the submodule (DeepSpeed's own package imports it on the way).
from zeroshard.runtime import lr_schedules  # noqa: E402, F401
