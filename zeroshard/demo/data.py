"""The demo's corpus: the running interpreter's own standard library source, as bytes.

Every Python installation carries it, so the demo needs no download. The files are read in
sorted order, so the corpus (and the train/validation split) is the same on every run and on
every rank of a given interpreter.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Directories left out: installed third-party packages are not the standard library, test
# suites are full of deliberately odd strings, `encodings` is mostly generated charmap tables and
# `pydoc_data` is generated English documentation.
SKIPPED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test", "encodings", "pydoc_data"}
)
DEFAULT_MAX_BYTES = 8_000_000
DEFAULT_VAL_FRACTION = 0.05


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_source_files(root: Path | None = None) -> list[Path]:
    """Every `.py` file under `root` (default: the stdlib), sorted by relative path."""
    root = stdlib_root() if root is None else Path(root)
    files = [path for path in root.rglob("*.py") if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda path: path.relative_to(root).as_posix())


def load_stdlib_corpus(max_bytes: int = DEFAULT_MAX_BYTES, root: Path | None = None) -> torch.Tensor:
    """The source files concatenated (one newline between files), cut at `max_bytes`.

    Returns:
        A 1-D uint8 tensor; one element per byte.
    """
    if max_bytes < 2:
        raise ValueError(f"max_bytes={max_bytes}: the corpus needs at least 2 bytes.")
    chunks: list[bytes] = []
    total = 0
    for path in stdlib_source_files(root):
        if total >= max_bytes:
            break
        chunk = path.read_bytes() + b"\n"
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        where = stdlib_root() if root is None else root
        raise RuntimeError(
            f"no Python source files found under {where}: this interpreter ships its standard "
            "library without .py files, so the demo has no corpus. Run it with a regular "
            "CPython installation."
        )
    corpus = bytearray(b"".join(chunks)[:max_bytes])
    return torch.frombuffer(corpus, dtype=torch.uint8)


def split_train_val(
    corpus: torch.Tensor, val_fraction: float = DEFAULT_VAL_FRACTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first (1 - val_fraction) of the bytes for training, the rest for validation.

    A contiguous tail (not random windows) keeps validation text unseen: no window of one
    split overlaps the other.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: must be strictly between 0 and 1.")
    n_train = int(len(corpus) * (1.0 - val_fraction))
    return corpus[:n_train], corpus[n_train:]


class ByteWindows(Dataset):
    """Non-overlapping windows of a byte tensor, as next-byte prediction pairs.

    Item i is (x, y) with x = data[i*T : i*T + T] and y = data[i*T + 1 : i*T + T + 1], both
    int64 of length T = block_size. Map-style, so a DistributedSampler can shard it.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        if data.dim() != 1:
            raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}.")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be at least 1.")
        if len(data) < block_size + 1:
            raise ValueError(
                f"{len(data)} bytes are too few for one window of block_size={block_size} "
                "(it needs block_size + 1 bytes). Use a larger corpus or a smaller block_size."
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        # The last window needs one byte past its end for its final target.
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows.")
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def build_datasets(
    block_size: int,
    max_bytes: int = DEFAULT_MAX_BYTES,
    val_fraction: float = DEFAULT_VAL_FRACTION,
) -> tuple[ByteWindows, ByteWindows]:
    """Train and validation windows over the stdlib corpus."""
    train, val = split_train_val(load_stdlib_corpus(max_bytes), val_fraction)
    return ByteWindows(train, block_size), ByteWindows(val, block_size)
