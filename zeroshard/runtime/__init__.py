"""DeepSpeed's `deepspeed.runtime` import paths that users' scripts and the Hugging Face
integrations name. Each submodule is imported here, so that `deepspeed.runtime.lr_schedules...`
reads as an attribute after a bare `import deepspeed` (Accelerate reads it that way), as in
DeepSpeed, whose engine imports them all."""

from zeroshard.runtime import config, engine, lr_schedules, sequence_parallel, utils, zero

__all__ = ["config", "engine", "lr_schedules", "sequence_parallel", "utils", "zero"]
