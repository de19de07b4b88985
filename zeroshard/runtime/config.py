"""`deepspeed.runtime.config`'s names that scripts import: `DeepSpeedConfigError`."""

from ..config_error import DeepSpeedConfigError

__all__ = ["DeepSpeedConfigError"]
