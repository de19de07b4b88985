"""Rank-side scenarios for tests/dist/sharding/test_stage3_master_gather.py: stage 3 with bf16 or
fp16 parameters and fp32 masters gathers by casting the master, keeping no parameter shard."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

import zeroshard.sharding.flat as flat_module
from tests.dist.scenarios.common import Case, build_engine, train

PATHS = ("master", "shard")  # gather from the master (now); from a kept parameter shard (before)


@contextlib.contextmanager
def _gather_source(path: str):
    """`shard` builds flats as before the change: a persistent parameter-dtype shard that
    publish writes and the gathers read."""
    real = flat_module.master_feeds_gather
    if path == "shard":
        flat_module.master_feeds_gather = lambda role, offloaded: False
    try:
        yield
    finally:
        flat_module.master_feeds_gather = real


def live_bytes() -> int:
    """Bytes of every distinct storage a live tensor holds (benchmarks/gpu_check/held_bytes.py's
    count): what stays allocated between steps."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
        except ReferenceError:  # a dead weak proxy
            continue
        storage = obj.untyped_storage()
        seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def held_between_steps(mode: str, path: str) -> dict[str, Any]:
    """Train 2 steps keeping nothing; the bytes the engine holds between steps (what is freed
    with it), and this rank's shard elements.

    Counted as what dies with the engine, not as what was born since a baseline: storage of
    earlier runs that the collector releases in the meantime (seen: a 4,976-byte fp32 copy of
    TinyModel's parameters, in one run of three) would otherwise be subtracted from it."""
    case = Case(stage=3, mode=mode, steps=2, keep=())
    with _gather_source(path):
        engine = build_engine(case)
        result = train(engine, case)
    out = {
        "shard_numel": sum(f.shard_numel for f in engine.flats if f.params_sharded),
        "sharded_flats": sum(f.params_sharded for f in engine.flats),
        "param_shards": sum(f.param_shard is not None for f in engine.flats),
        "losses": result["losses"],
    }
    with_engine = live_bytes()
    engine.destroy()
    del engine
    out["held"] = with_engine - live_bytes()
    return out


def trained(mode: str, path: str, steps: int = 3) -> dict[str, Any]:
    """`train` with masters, module parameters and the first gradient after every step."""
    case = Case(stage=3, mode=mode, steps=steps)
    with _gather_source(path):
        engine = build_engine(case)
        result = train(engine, case)
    engine.destroy()
    return result


def both_paths(mode: str) -> dict[str, Any]:
    return {
        "held": {path: held_between_steps(mode, path) for path in PATHS},
        "trained": {path: trained(mode, path) for path in PATHS},
    }
