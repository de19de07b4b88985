"""The demo corpus: stdlib source as bytes, split and cut into next-byte windows."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from zeroshard.demo.data import (
    ByteWindows,
    build_datasets,
    load_stdlib_corpus,
    split_train_val,
    stdlib_source_files,
)


def test_corpus_is_the_stdlib_source_in_sorted_order() -> None:
    files = stdlib_source_files()
    names = [p.name for p in files]
    assert "os.py" in names and "functools.py" in names
    assert not any("site-packages" in p.parts for p in files)
    corpus = load_stdlib_corpus(max_bytes=200_000)
    assert corpus.dtype == torch.uint8 and corpus.shape == (200_000,)
    # The corpus starts with the first file's bytes, exactly.
    first = files[0].read_bytes()[:1000]
    assert bytes(corpus[: len(first)].tolist()) == first


def test_corpus_is_deterministic() -> None:
    a = load_stdlib_corpus(max_bytes=300_000)
    b = load_stdlib_corpus(max_bytes=300_000)
    assert torch.equal(a, b)


def test_corpus_from_a_directory_of_files(tmp_path) -> None:
    (tmp_path / "b.py").write_bytes(b"BBB")
    (tmp_path / "a.py").write_bytes(b"AA")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "c.py").write_bytes(b"skipped")
    (tmp_path / "notes.txt").write_bytes(b"not python")
    corpus = load_stdlib_corpus(max_bytes=100, root=tmp_path)
    assert bytes(corpus.tolist()) == b"AA\nBBB\n"
    with pytest.raises(RuntimeError, match="no Python source files found"):
        load_stdlib_corpus(root=tmp_path / "test" / "missing")


def test_windows_line_up_x_and_y_shifted_by_one() -> None:
    data = torch.arange(23, dtype=torch.uint8)
    windows = ByteWindows(data, block_size=5)
    assert len(windows) == 4  # 22 // 5: the last window needs one byte beyond it
    for i in range(len(windows)):
        x, y = windows[i]
        assert x.dtype == torch.int64 and y.dtype == torch.int64
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    with pytest.raises(IndexError):
        windows[4]


def test_windows_do_not_overlap_and_cover_the_data() -> None:
    data = torch.arange(200, dtype=torch.uint8)
    windows = ByteWindows(data, block_size=16)
    xs = torch.cat([windows[i][0] for i in range(len(windows))])
    assert xs.tolist() == list(range(len(windows) * 16))


def test_train_and_val_are_disjoint_and_complete() -> None:
    corpus = load_stdlib_corpus(max_bytes=100_000)
    train, val = split_train_val(corpus, val_fraction=0.05)
    assert len(train) == 95_000 and len(val) == 5_000
    assert torch.equal(torch.cat([train, val]), corpus)
    # Windows index into their own split only: the last train target is byte 94_999 at most.
    train_windows = ByteWindows(train, block_size=64)
    last_x, last_y = train_windows[len(train_windows) - 1]
    assert (len(train_windows) - 1) * 64 + 64 < len(train)
    assert torch.equal(last_y[-1:], train[(len(train_windows) - 1) * 64 + 64].long().view(1))
    with pytest.raises(ValueError, match="val_fraction=1.5"):
        split_train_val(corpus, 1.5)


def test_distributed_sampler_shards_the_windows() -> None:
    train, _ = build_datasets(block_size=64, max_bytes=50_000)
    shards = [list(DistributedSampler(train, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in range(2)]
    # 47_500 train bytes make 742 windows: an even count, so the sampler adds no padding
    # and every window goes to exactly one rank.
    assert len(train) == 742
    assert len(shards[0]) == len(shards[1]) == 371
    assert sorted(shards[0] + shards[1]) == list(range(len(train)))


def test_too_small_data_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="too few for one window of block_size=8"):
        ByteWindows(torch.zeros(8, dtype=torch.uint8), block_size=8)
