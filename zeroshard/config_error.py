"""The error every bad config raises (a module of its own so that the config file reader, the
section models and the builders' rules can all raise it without importing each other)."""

from __future__ import annotations

__all__ = ["ConfigError"]


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
