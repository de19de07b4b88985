"""The error every bad config raises (a module of its own so that the config file reader, the
section models and the builders' rules can all raise it without importing each other)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__ = ["ConfigError", "DeepSpeedConfigError", "raises_deepspeed_error"]


class ConfigError(ValueError):
    """A config the user gave cannot be used. The message lists every problem, one per line.

    Attributes:
        problems: one entry per problem, each starting with the JSON path of the key.
    """

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = "invalid config:\n" + "\n".join(f"  {p}" for p in self.problems)
        super().__init__(message)


class DeepSpeedConfigError(ConfigError):
    """DeepSpeed's name for a config error (``deepspeed.runtime.config.DeepSpeedConfigError``).

    The public entry points (``initialize``, ``resolve_config``) raise this
    subclass, so a script's ``except DeepSpeedConfigError`` and ``except ConfigError`` (or
    ``ValueError``) both catch every config problem.
    """


F = TypeVar("F", bound=Callable)


def raises_deepspeed_error(fn: F) -> F:
    """Make a public entry point raise ``DeepSpeedConfigError`` for any ``ConfigError`` inside."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeepSpeedConfigError:
            raise
        except ConfigError as exc:
            raise DeepSpeedConfigError(exc.problems) from None

    return wrapper  # type: ignore[return-value]
