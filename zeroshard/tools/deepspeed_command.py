"""The `deepspeed` command the alias installs: an executable script next to `python`.

A DeepSpeed user starts training with `deepspeed --num_gpus N train.py ...`; the alias writes
that command (zeroshard/launch/deepspeed_launcher.py's `main`) where pip puts a package's
console scripts: the environment's scripts folder, or `DIR/bin` for `--target DIR` (as
`pip install --target` does). The alias lists it in its RECORD (path relative to the
site-packages folder) and names it in entry_points.txt, so `pip uninstall deepspeed` removes it.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

NAME = "deepspeed"
ENTRY_POINT = "zeroshard.launch.deepspeed_launcher:main"
MARKER = "# zeroshard deepspeed command"  # second line of our script: how we know our own file
ENTRY_POINTS_TXT = f"[console_scripts]\n{NAME} = {ENTRY_POINT}\n"


def scripts_dir(target: Path | None) -> Path:
    """Where the command goes: `target/bin` for a `--target` folder, else this environment's scripts."""
    return target / "bin" if target is not None else Path(sysconfig.get_path("scripts"))


def shebang(python: str) -> str:
    """`#!python`, or, where the kernel cannot take that line (a space in the path, or longer than
    Linux's 127 bytes), `/bin/sh` running the file with python: the form pip's script maker
    writes then, whose second and third lines are a string statement to Python."""
    if " " not in python and len(python.encode()) + 2 <= 127:
        return f"#!{python}\n"
    quoted = python.replace("'", "'\"'\"'")
    return "#!/bin/sh\n" + "'''exec' '" + quoted + "' \"$0\" \"$@\"\n" + "' '''\n"


def script_text(python: str) -> str:
    module, _, function = ENTRY_POINT.partition(":")
    return (
        shebang(python) +
        f"{MARKER} (`zeroshard install-deepspeed-alias`; undo with `--uninstall` or `pip uninstall deepspeed`)\n"
        "import sys\n\n"
        f"from {module} import {function}\n\n"
        "if __name__ == \"__main__\":\n"
        f"    sys.exit({function}())\n"
    )


def is_ours(path: Path) -> bool:
    """Whether `path` is our command: MARKER on one of its first lines (after the `#!` line, or
    after the three lines of the `/bin/sh` form)."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return any(handle.readline().startswith(MARKER) for _ in range(4))
    except OSError:
        return False


def foreign_script(folder: Path) -> Path | None:
    """The `deepspeed` file in `folder` when it is not ours (DeepSpeed's own command, say)."""
    path = folder / NAME
    if (path.exists() or path.is_symlink()) and not is_ours(path):
        return path
    return None


def write_script(folder: Path, python: str) -> tuple[Path, bytes]:
    """Write the executable command into `folder`; returns its path and bytes (for RECORD)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / NAME
    data = script_text(python).encode("utf-8")
    path.write_bytes(data)
    os.chmod(path, 0o755)
    return path, data


def record_path(path: Path, site: Path) -> str:
    """RECORD's spelling of `path`: relative to the site-packages folder, `../` where it lies outside."""
    return Path(os.path.relpath(path.resolve(), site.resolve())).as_posix()
