"""The "did you mean" hint of every unknown-name message (config keys, optimizer and
scheduler types and parameters, Muon's keys), and the "moved to" hint for a config key known
under another path (zeroshard/config/moved_keys.py)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from zeroshard.config.moved_keys import MOVED_KEYS

KNOWN_KEYS_HERE = "Known keys here"


def did_you_mean(
    word: str, choices: Iterable[str], known: str | None = KNOWN_KEYS_HERE, key_path: str | None = None,
) -> str:
    """A sentence to append to a message about the unknown `word`, with its leading space.

    " Did you mean 'x'?" for the closest of `choices` (difflib's ratio of at least 0.6; else
    one equal to `word` but for case); without one, " <known>: a, b, c." listing every choice,
    sorted, or "" when `known` is None (a message that lists them itself). A config key whose
    written path `key_path` is in MOVED_KEYS gets " Moved to 'new.path' (origin)." instead of a
    spelling guess.
    """
    if key_path is not None and (moved := MOVED_KEYS.get(key_path)) is not None:
        return f" Moved to '{moved.to}' ({moved.origin})."
    choices = list(choices)
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == word.lower()]
    if close:
        return f" Did you mean '{close[0]}'?"
    return "" if known is None else f" {known}: {', '.join(sorted(choices))}."
