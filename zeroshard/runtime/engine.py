"""DeepSpeed's `deepspeed.runtime.engine` path: `DeepSpeedEngine` is zeroshard's engine class
(what `deepspeed.initialize` returns), for `isinstance` checks in integrations."""

from zeroshard.engine.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
