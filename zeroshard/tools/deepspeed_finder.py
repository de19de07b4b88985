"""`deepspeed.X.Y` is `zeroshard.X.Y`: the import hook behind the `deepspeed` alias.

The alias distribution (`zeroshard install-deepspeed-alias`, zeroshard/tools/deepspeed_alias.py)
installs a one-file package `deepspeed` whose `__init__` puts zeroshard itself in
`sys.modules["deepspeed"]` and calls `install()` here. From then on every `import deepspeed.X.Y`
is answered by the finder below with the module object `zeroshard.X.Y`, so there is one copy of
each module and `isinstance` sees one class. Without the finder the path finder would search
zeroshard's folders under the name `deepspeed.X` and execute every file a second time.

A DeepSpeed path that zeroshard has no module for raises ModuleNotFoundError naming that path
(an `except ImportError` in the caller still takes its fallback, as with a DeepSpeed built
without that op).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

ALIAS = "deepspeed"
TARGET = "zeroshard"
# What to do instead, for DeepSpeed paths that integrations import and zeroshard leaves out.
_INSTEAD = {
    "deepspeed.ops.lion": "zeroshard's host optimizers are DeepSpeedCPUAdam and DeepSpeedCPUAdagrad: train with AdamW, "
    "or keep Lion without offload_optimizer.",
}


class _ExistingModuleLoader(importlib.abc.Loader):
    """Hands the import system the zeroshard module instead of a new one."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_target_name(spec.name))
        # module_from_spec writes the alias's spec over the module's own (`__spec__` is set
        # whatever the module held); keep it here and put it back in exec_module.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """Finds `deepspeed.X.Y` as the already imported (or importable) `zeroshard.X.Y`."""

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001 (importlib's signature)
        if not fullname.startswith(ALIAS + "."):
            return None  # `deepspeed` itself is the alias package on sys.path
        name = _target_name(fullname)
        module = sys.modules.get(name)
        # Only look here (under the global import lock); the import itself runs in create_module.
        found = module.__spec__ if module is not None else importlib.util.find_spec(name)
        if found is None:
            instead = f"{_INSTEAD[fullname]} " if fullname in _INSTEAD else ""
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: zeroshard, which `deepspeed` names in this environment (the "
                f"alias from `zeroshard install-deepspeed-alias`), does not provide {fullname}. "
                f"{instead}See "
                "docs/migrating-from-deepspeed.md for what it covers; to use the real DeepSpeed, run "
                "`zeroshard install-deepspeed-alias --uninstall` and `pip install deepspeed`.",
                name=fullname,
            )
        return importlib.machinery.ModuleSpec(
            fullname, _ExistingModuleLoader(), is_package=found.submodule_search_locations is not None
        )


def _target_name(alias_name: str) -> str:
    return TARGET + alias_name[len(ALIAS):]


def install() -> DeepSpeedAliasFinder:
    """Put the finder first on `sys.meta_path` (once), before the path finder that would load a
    second copy; returns it."""
    for finder in sys.meta_path:
        if isinstance(finder, DeepSpeedAliasFinder):
            return finder
    finder = DeepSpeedAliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
