"""Whether `import deepspeed` would reach the zeroshard alias or something earlier on sys.path.

The alias (zeroshard/tools/deepspeed_alias.py) is a package `deepspeed/` in site-packages. Python
imports the first `deepspeed` on `sys.path`, so a DeepSpeed source checkout earlier on the path
(the working directory of a script run from inside it, a PYTHONPATH entry) is imported instead,
and the integrations that `import deepspeed` silently get that checkout while
`importlib.metadata.version("deepspeed")` still says `0.19.8+zeroshard`. `install` refuses such a
path and `import zeroshard` warns when the alias is installed but shadowed; both name the path.

Light on purpose (imported by `import zeroshard`): one path search (cached directory listings)
and, only when something other than the alias is found, a scan of the path for the alias.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

ALIAS = "deepspeed"
MARKER = "# zeroshard deepspeed alias"  # the first line of the alias's __init__ (deepspeed_alias.py)


def location(spec: importlib.machinery.ModuleSpec | None) -> Path | None:
    """Where a found `deepspeed` lives: its package folder (or module file)."""
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin) if spec.origin else None


def is_alias_package(folder: Path) -> bool:
    init = folder / "__init__.py"
    try:
        with init.open(encoding="utf-8", errors="replace") as handle:
            return handle.readline().startswith(MARKER)
    except OSError:
        return False


def first_deepspeed(paths: Sequence[str]) -> Path | None:
    """The `deepspeed` that `import deepspeed` finds on `paths` ('' is the working directory),
    or None."""
    return location(importlib.machinery.PathFinder.find_spec(ALIAS, [p or os.getcwd() for p in paths]))


def shadowed_alias(paths: Sequence[str]) -> tuple[Path, Path] | None:
    """(what `import deepspeed` finds, the alias it hides) when the alias is on `paths` but
    something else comes first; None otherwise."""
    found = first_deepspeed(paths)
    if found is None or is_alias_package(found):
        return None
    for entry in paths:
        candidate = Path(entry or os.getcwd()) / ALIAS
        if candidate != found and is_alias_package(candidate):
            return found, candidate
    return None


def shadow_message(found: Path, alias: Path) -> str:
    return (
        f"`import deepspeed` finds {found} (earlier on sys.path: a DeepSpeed source checkout or another "
        f"package named deepspeed), not the zeroshard alias at {alias}; code that imports deepspeed gets that "
        "instead of zeroshard. Run from another folder, or take that path out of sys.path (PYTHONPATH)."
    )


def warn_if_shadowed() -> None:
    """At `import zeroshard`: a warning naming the path when the installed alias is shadowed."""
    shadow = shadowed_alias(sys.path)
    if shadow is not None:
        warnings.warn(shadow_message(*shadow), stacklevel=3)
