"""`zeroshard install-deepspeed-alias`: a distribution named `deepspeed` that is zeroshard.

Hugging Face transformers, Accelerate and TRL look for DeepSpeed with
`importlib.util.find_spec("deepspeed")` and `importlib.metadata.version("deepspeed")`, and then
`import deepspeed...`. This writes, into site-packages (or `--target DIR`), the smallest
distribution that answers all three: a package `deepspeed/` whose `__init__` makes `deepspeed`
the zeroshard module itself (zeroshard/tools/deepspeed_finder.py maps every `deepspeed.X.Y` to
`zeroshard.X.Y`), and a `.dist-info` with METADATA (version `0.19.8+zeroshard`, the DeepSpeed
release whose API zeroshard matches, so the integrations' version checks pass), RECORD,
INSTALLER, top_level.txt and entry_points.txt, so that `pip uninstall deepspeed` removes it like
any package. It also installs the `deepspeed` command (zeroshard/tools/deepspeed_command.py:
DeepSpeed's launcher on one node, zeroshard/launch/deepspeed_launcher.py), listed in RECORD.

The files are generated here rather than kept as a folder of package data: they are two lines
of code and metadata whose RECORD must hash what was written, and a module string ships with
every kind of zeroshard install (wheel, editable, a source tree on PYTHONPATH) without a
package-data rule. Nothing is downloaded; pip is not needed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from zeroshard.tools import deepspeed_command, deepspeed_shadow

DISTRIBUTION = "deepspeed"
# DeepSpeed's release whose API zeroshard follows; `+zeroshard` marks the alias (a local version
# label: it compares equal to 0.19.8 in every `>=`/`<` check the integrations make).
VERSION = "0.19.8+zeroshard"
LOCAL_LABEL = "+zeroshard"
DIST_INFO = f"{DISTRIBUTION}-{VERSION}.dist-info"
MARKER = deepspeed_shadow.MARKER  # first line of the alias's __init__: how we know our own files

INIT_SOURCE = f'''{MARKER} (`zeroshard install-deepspeed-alias`; undo with `--uninstall` or `pip uninstall deepspeed`).
"""`deepspeed` is zeroshard in this environment: `import deepspeed` gives the zeroshard module and
every `deepspeed.X.Y` the module `zeroshard.X.Y` (one copy of each)."""
import sys

import zeroshard
from zeroshard.tools import deepspeed_finder

deepspeed_finder.install()
sys.modules[__name__] = zeroshard  # what `import deepspeed` returns
'''

METADATA = f"""Metadata-Version: 2.1
Name: {DISTRIBUTION}
Version: {VERSION}
Summary: zeroshard under the name deepspeed (`zeroshard install-deepspeed-alias`)
Requires-Dist: zeroshard

"""


class AliasError(RuntimeError):
    """The alias cannot be installed or removed here (the message says why and what to do)."""


def default_target() -> Path:
    """The running environment's site-packages (`purelib`), where pip would install."""
    return Path(sysconfig.get_paths()["purelib"])


def install(target: str | Path | None = None, scripts: str | Path | None = None) -> Path:
    """Install the alias into `target` (default: site-packages); returns its `deepspeed/` folder.

    Also writes the `deepspeed` command (zeroshard/tools/deepspeed_command.py) into `scripts`
    (default: `target/bin` for an explicit target, else this environment's scripts folder).
    Reinstalling over the alias replaces it. Raises AliasError when a real DeepSpeed is installed
    there or anywhere on sys.path, or a `deepspeed` command that is not ours is in `scripts`.
    """
    explicit = target is not None
    target = Path(target) if target is not None else default_target()
    scripts = Path(scripts) if scripts is not None else deepspeed_command.scripts_dir(target if explicit else None)
    _refuse_real_deepspeed(target)
    _refuse_shadowing(target)
    foreign = deepspeed_command.foreign_script(scripts)
    if foreign is not None:
        raise AliasError(
            f"{foreign} exists and is not the zeroshard alias's command (DeepSpeed's own launcher or another "
            "program); remove it (`pip uninstall deepspeed` if it is DeepSpeed's), then run "
            "`zeroshard install-deepspeed-alias` again."
        )
    if _own_dist_info(target) is not None:
        uninstall(target)
    package = target / DISTRIBUTION
    dist_info = target / DIST_INFO
    package.mkdir(parents=True, exist_ok=True)
    dist_info.mkdir(exist_ok=True)
    files = {
        package / "__init__.py": INIT_SOURCE,
        dist_info / "METADATA": METADATA,
        dist_info / "INSTALLER": "zeroshard\n",
        dist_info / "top_level.txt": f"{DISTRIBUTION}\n",
        dist_info / "entry_points.txt": deepspeed_command.ENTRY_POINTS_TXT,
    }
    written = []
    for path, text in files.items():
        data = text.encode("utf-8")
        path.write_bytes(data)
        written.append((path, data))
    written.append(deepspeed_command.write_script(scripts, sys.executable))
    rows = []
    for path, data in written:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode("ascii")
        rows.append(f"{deepspeed_command.record_path(path, target)},sha256={digest},{len(data)}")
    rows.append(f"{DIST_INFO}/RECORD,,")
    (dist_info / "RECORD").write_text("\n".join(rows) + "\n", encoding="utf-8")
    importlib.invalidate_caches()
    return package


def uninstall(target: str | Path | None = None) -> bool:
    """Remove the alias from `target` (default: site-packages); False when it was not there.

    Refuses (AliasError) to touch a real DeepSpeed.
    """
    target = Path(target) if target is not None else default_target()
    dist_info = _own_dist_info(target)
    if dist_info is None:
        if _real_versions([target]):
            raise AliasError(
                f"{target} holds a real DeepSpeed ({', '.join(_real_versions([target]))}), not the zeroshard "
                "alias: remove it with `pip uninstall deepspeed` if that is what you want."
            )
        return False
    for row in (dist_info / "RECORD").read_text(encoding="utf-8").splitlines():
        relative = row.split(",")[0]
        path = target / relative
        # The command lies outside `target` (`../../../bin/deepspeed`); remove only ours.
        if relative and (not relative.startswith("../") or deepspeed_command.is_ours(path)):
            path.unlink(missing_ok=True)
    shutil.rmtree(target / DISTRIBUTION / "__pycache__", ignore_errors=True)
    for folder in (target / DISTRIBUTION, dist_info, target / "bin"):  # bin: the command's, with --target
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    importlib.invalidate_caches()
    return True


def _own_dist_info(target: Path) -> Path | None:
    """The alias's `.dist-info` in `target` (any version of it), or None."""
    for dist in importlib.metadata.distributions(name=DISTRIBUTION, path=[str(target)]):
        if _is_named_deepspeed(dist) and dist.version.endswith(LOCAL_LABEL):
            return Path(str(dist._path))  # type: ignore[attr-defined]  # PathDistribution's folder
    return None


def _is_named_deepspeed(dist: importlib.metadata.Distribution) -> bool:
    return (dist.metadata["Name"] or "").lower().replace("_", "-") == DISTRIBUTION


def _real_versions(paths: list[Path]) -> list[str]:
    """'VERSION at PATH' of each DeepSpeed distribution (not the alias) on `paths`."""
    found = []
    for dist in importlib.metadata.distributions(name=DISTRIBUTION, path=[str(p) for p in paths]):
        if _is_named_deepspeed(dist) and not dist.version.endswith(LOCAL_LABEL):
            found.append(f"deepspeed {dist.version} at {Path(str(dist._path)).parent}")  # type: ignore[attr-defined]
    return sorted(set(found))


def _refuse_real_deepspeed(target: Path) -> None:
    real = _real_versions([target, *(Path(p) for p in sys.path if p)])
    if real:
        raise AliasError(
            f"a real DeepSpeed is installed ({'; '.join(real)}); the alias would hide it. Use that DeepSpeed, "
            "or `pip uninstall deepspeed` first and then run `zeroshard install-deepspeed-alias` again."
        )
    init = target / DISTRIBUTION / "__init__.py"
    if (target / DISTRIBUTION).exists() and not (init.is_file() and _is_alias_file(init)):
        raise AliasError(
            f"{target / DISTRIBUTION} exists and is not the zeroshard alias (a DeepSpeed source tree or another "
            "package named deepspeed); move it away, then run `zeroshard install-deepspeed-alias` again."
        )


def _refuse_shadowing(target: Path) -> None:
    """Refuse when another `deepspeed` (a source checkout) would be imported instead of the alias:
    one in the working directory or on sys.path before `target` (all of sys.path when `target`
    is not on it)."""
    entries = [p or os.getcwd() for p in sys.path]
    resolved = [Path(p).resolve() for p in entries]
    before = entries[: resolved.index(target.resolve())] if target.resolve() in resolved else entries
    found = deepspeed_shadow.first_deepspeed([os.getcwd(), *before])
    if found is None or found.resolve() == (target / DISTRIBUTION).resolve():
        return
    if deepspeed_shadow.is_alias_package(found):
        return
    raise AliasError(
        f"{found} would be imported as `deepspeed` instead of the alias (it comes first on sys.path or is in the "
        f"working directory: a DeepSpeed source checkout or another package named deepspeed). Run from another "
        "folder and take that path out of sys.path (PYTHONPATH), then run `zeroshard install-deepspeed-alias` "
        "again."
    )


def _is_alias_file(path: Path) -> bool:
    with path.open(encoding="utf-8", errors="replace") as handle:
        return handle.readline().startswith(MARKER)
