"""`deepspeed.runtime.config`'s names that scripts import: `DeepSpeedConfigError`."""

from zeroshard.config.error import DeepSpeedConfigError

__all__ = ["DeepSpeedConfigError"]
