"""The "did you mean" hint of every unknown-name message (config keys, optimizer and
scheduler types and parameters, Muon's keys)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

KNOWN_KEYS_HERE = "Known keys here"


def did_you_mean(word: str, choices: Iterable[str], known: str | None = KNOWN_KEYS_HERE) -> str:
    """A sentence to append to a message about the unknown `word`, with its leading space.

    " Did you mean 'x'?" for the closest of `choices` (difflib's ratio of at least 0.6; else
    one equal to `word` but for case); without one, " <known>: a, b, c." listing every choice,
    sorted, or "" when `known` is None (a message that lists them itself).
    """
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == word.lower()]
    if close:
        return f" Did you mean '{close[0]}'?"
    return "" if known is None else f" {known}: {', '.join(sorted(choices))}."
