"""Reading a config file: UTF-8 JSON, or HJSON as DeepSpeed also reads, into a plain dict.

Every way a file can be unusable is one ``ConfigError`` naming the file: unreadable, not
UTF-8, not JSON/HJSON, not an object, a key given twice in one object (JSON would silently
keep the last value), or nested deeper than any config needs (which would otherwise end in a
``RecursionError`` inside the parser or the validator).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zeroshard.config.error import ConfigError

__all__ = ["MAX_DEPTH", "check_depth", "read_config_file"]

# DeepSpeed configs are at most four levels deep; anything past this is not a config.
MAX_DEPTH = 64


class _Object(dict):
    """A parsed JSON object that remembers the keys it was given more than once."""

    duplicates: list[str]


def _pairs_to_object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    seen: set[str] = set()
    duplicates: list[str] = []
    for key, value in pairs:
        if key in seen and key not in duplicates:
            duplicates.append(key)
        seen.add(key)
        obj[key] = value
    obj.duplicates = duplicates
    return obj


def _duplicate_paths(data: Any) -> list[str]:
    """JSON paths of every key written twice, found without recursion."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key in getattr(value, "duplicates", ()):
                found.append(f"{path}.{key}" if path else str(key))
            stack.extend((v, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))
    return sorted(found)


def _plain(data: Any) -> Any:
    """Plain dicts and lists (the parsers' own types dropped), without recursion."""
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(data, root, 0)]
    while stack:
        value, parent, slot = stack.pop()
        if isinstance(value, dict):
            copy: Any = dict.fromkeys(value)  # keys in the file's order; values filled below
            stack.extend((v, copy, k) for k, v in value.items())
        elif isinstance(value, list):
            copy = [None] * len(value)
            stack.extend((v, copy, i) for i, v in enumerate(value))
        else:
            copy = value
        parent[slot] = copy
    return root[0]


def check_depth(data: Any, where: str) -> None:
    """Refuse a config nested deeper than ``MAX_DEPTH`` (checked without recursion).

    Raises:
        ConfigError: naming ``where`` and the path at which the limit is passed.
    """
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(
                f"{where} is nested more than {MAX_DEPTH} levels deep (at {path[:80]}...). "
                "A DeepSpeed config is a few levels deep; check the file was generated correctly."
            )
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value))


def _parse_hjson(text: str) -> Any:
    import hjson

    return hjson.loads(text, object_pairs_hook=_pairs_to_object)


def read_config_file(path: Path) -> dict[str, Any]:
    """The config object a JSON or HJSON file holds.

    A file named ``*.hjson`` is read as HJSON; any other is read as JSON and, if that fails,
    as HJSON (DeepSpeed reads every config with the ``hjson`` package, and JSON is a subset).

    Raises:
        ConfigError: for every way the file is unusable, naming the file.
    """
    name = repr(str(path))
    try:
        data_bytes = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {name} cannot be read: {exc.strerror or exc}.") from None
    try:
        text = data_bytes.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {name} is not UTF-8 text (byte 0x{data_bytes[exc.start]:02x} at offset "
            f"{exc.start}). Save it as UTF-8."
        ) from None
    try:
        if path.suffix.lower() == ".hjson":
            data = _parse_hjson(text)
        else:
            try:
                data = json.loads(text, object_pairs_hook=_pairs_to_object)
            except json.JSONDecodeError as json_error:
                try:
                    data = _parse_hjson(text)
                except Exception:  # noqa: BLE001 - any HJSON failure: report the JSON error
                    raise ConfigError(
                        f"config file {name} is not valid JSON: {json_error.msg} at line {json_error.lineno}, "
                        f"column {json_error.colno} (nor valid HJSON)."
                    ) from None
    except RecursionError:
        raise ConfigError(
            f"config file {name} is nested too deeply to parse. A DeepSpeed config is a few levels deep; "
            "check the file was generated correctly."
        ) from None
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the hjson parser's own error types
        raise ConfigError(f"config file {name} is not valid HJSON: {exc}.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {name} must hold a JSON object, not {type(data).__name__}.")
    check_depth(data, f"config file {name}")
    duplicates = _duplicate_paths(data)
    if duplicates:
        raise ConfigError(
            [f"{key}: given more than once in config file {name} (JSON keeps only the last value). "
             "Keep one." for key in duplicates]
        )
    return _plain(data)
