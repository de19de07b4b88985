"""Writing checkpoint files safely: never through a symbolic link, in the umask's mode, durable.

A save directory may be shared (a cluster scratch space), so whoever else can write there
could plant a symbolic link where a save is about to write (`.latest.tmp`, an export's
temporary file) and have the save overwrite the link's target. Every file a save writes is
therefore either created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`: a planted entry is
removed first, and one planted again in between makes the open fail instead of following
it), or written by a library into a directory this process has just created exclusively and
then renamed into place (a rename replaces a link, it never writes through one).

Files are given mode 0666 minus the umask, as `open()` would: safetensors writes its files
0600, which made a checkpoint's shards and its index differ in who could read them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask sets it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a newly created file gets from `open()`: 0666 minus the umask."""
    return 0o666 & ~current_umask()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file inside `path` durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def finish_file(path: Path) -> None:
    """Give a file a library wrote (safetensors: 0600) the umask's mode, and fsync it.

    Opened with O_NOFOLLOW, so a link in its place is an error, never a chmod of its target.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        os.fchmod(fd, file_mode())
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_entry(path: Path) -> None:
    """Remove a file, a symbolic link (never its target) or a directory tree, if present."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


@contextmanager
def open_exclusive(path: Path) -> Iterator[BinaryIO]:
    """A new file at `path` for writing, created exclusively; whatever was there is removed first.

    Raises:
        FileExistsError: something was put at `path` again between the removal and the open.
    """
    remove_entry(path)
    fd = os.open(path, _CREATE_FLAGS, 0o666)
    with os.fdopen(fd, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())


def write_bytes_exclusive(path: Path, data: bytes) -> None:
    with open_exclusive(path) as f:
        f.write(data)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old content or the new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    write_bytes_exclusive(tmp, text.encode("utf-8"))
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_via_private_dir(path: Path, write: Callable[[Path], None]) -> None:
    """Atomically create `path` with `write(tmp_path)`, a library call that writes by name.

    `write` writes into a fresh 0700 directory next to `path` (tempfile.mkdtemp: exclusive,
    unique), where nobody else can plant a link; the file is then renamed into place.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        tmp = private / path.name
        write(tmp)
        finish_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        shutil.rmtree(private, ignore_errors=True)
