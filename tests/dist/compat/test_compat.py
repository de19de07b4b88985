"""zeroshard.comm.compat: the flat collectives under torch's newest names and under the older
ones (reduce_scatter_tensor, all_gather_into_tensor), on a real 2- and 3-rank gloo group.

The older torch is simulated by deleting the new names from torch.distributed inside the
task (restored afterwards). Values are small integers in float32, so sums are exact and
compared with torch.equal against the formula.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import compat as _compat

NEW_NAMES = ("reduce_scatter_single", "all_gather_single")
OLD_NAMES = ("reduce_scatter_tensor", "all_gather_into_tensor")
CHUNK = 5


@contextlib.contextmanager
def _without_new_names():
    saved = {name: dist.__dict__.pop(name) for name in NEW_NAMES if name in dist.__dict__}
    try:
        yield
    finally:
        dist.__dict__.update(saved)


@contextlib.contextmanager
def _counting(names: tuple[str, ...], calls: dict[str, int]):
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _collectives() -> dict[str, torch.Tensor]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    # Rank r contributes (r + 1) * [0, 1, ..., ws * CHUNK - 1].
    full = (rank + 1) * torch.arange(ws * CHUNK, dtype=torch.float32)
    out = {}
    for async_op in (False, True):
        shard = torch.empty(CHUNK)
        work = _compat.reduce_scatter_single(shard, full.clone(), group=None, async_op=async_op)
        if async_op:
            work.wait()
        out[f"reduce_scatter async={async_op}"] = shard
        gathered = torch.empty(ws * CHUNK)
        work = _compat.all_gather_single(gathered, torch.full((CHUNK,), float(rank)), async_op=async_op)
        if async_op:
            work.wait()
        out[f"all_gather async={async_op}"] = gathered
    return out


def both_name_sets() -> dict:
    """The collectives with torch's names as installed, then with the new names removed."""
    calls_new, calls_old = {}, {}
    with _counting(NEW_NAMES + OLD_NAMES, calls_new):
        with_new = _collectives()
    with _without_new_names(), _counting(OLD_NAMES, calls_old):
        assert not hasattr(dist, "reduce_scatter_single") and not hasattr(dist, "all_gather_single")
        with_old = _collectives()
    restored = all(hasattr(dist, name) for name in NEW_NAMES)
    return {"new": with_new, "old": with_old, "calls_new": calls_new, "calls_old": calls_old, "restored": restored}


@pytest.mark.parametrize("world_size", [2, 3])
def test_flat_collectives_with_new_and_old_torch_names(dist_pool, world_size):
    per_rank = dist_pool(world_size).run(both_name_sets, timeout=60)
    total = sum(r + 1 for r in range(world_size))
    gathered = torch.arange(world_size, dtype=torch.float32).repeat_interleave(CHUNK)
    for rank, result in enumerate(per_rank):
        expected_shard = total * torch.arange(rank * CHUNK, (rank + 1) * CHUNK, dtype=torch.float32)
        for names in ("new", "old"):
            for async_op in (False, True):
                assert torch.equal(result[names][f"reduce_scatter async={async_op}"], expected_shard), (names, rank)
                assert torch.equal(result[names][f"all_gather async={async_op}"], gathered), (names, rank)
        # The installed torch (2.13 here) has the new names and they are used; removed, the old ones are.
        assert result["calls_new"] == {"reduce_scatter_single": 2, "all_gather_single": 2}, result["calls_new"]
        assert result["calls_old"] == {"reduce_scatter_tensor": 2, "all_gather_into_tensor": 2}, result["calls_old"]
        assert result["restored"]


def test_neither_name_says_which_torch_to_install(monkeypatch):
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        monkeypatch.delattr(dist, name, raising=False)
    with pytest.raises(AttributeError, match="neither reduce_scatter_single nor reduce_scatter_tensor.*torch 2.4"):
        _compat.reduce_scatter_single(torch.empty(1), torch.empty(2))
