"""Rank-side scenarios for tests/dist/sharding/test_stage3_master_gather.py: stage 3 with bf16 or
fp16 parameters and fp32 masters gathers by casting the master, keeping no parameter shard."""

from __future__ import annotations

import contextlib
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


def engine_bytes(engine) -> int:
    """Bytes of every distinct storage the engine's flats hold between steps: full buffers,
    16-bit parameter shards, masters, gradient buffers and the optimizer's state of each master.
    (Counting every live tensor through the garbage collector instead also caught small
    tensors of unrelated objects, 28 bytes off in one run of the whole suite.)"""
    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())

    state = engine.optimizer.state if engine.optimizer is not None else {}
    for flat in engine.flats:
        for t in (flat.full, flat.param_shard, flat.master, flat.master.grad,
                  flat.grads.local, flat.grads.reduced, flat.grads.reduced_full):
            add(t)
        for value in state.get(flat.master, {}).values():
            add(value)
    seen.pop(0, None)  # freed buffers (a null pointer) hold nothing
    return sum(seen.values())


def held_between_steps(mode: str, path: str) -> dict[str, Any]:
    """Train 2 steps keeping nothing; the bytes the engine's flats hold between steps, and this
    rank's shard elements."""
    case = Case(stage=3, mode=mode, steps=2, keep=())
    with _gather_source(path):
        engine = build_engine(case)
        result = train(engine, case)
    out = {
        "shard_numel": sum(f.shard_numel for f in engine.flats if f.params_sharded),
        "sharded_flats": sum(f.params_sharded for f in engine.flats),
        "param_shards": sum(f.param_shard is not None for f in engine.flats),
        "losses": result["losses"],
        "held": engine_bytes(engine),
    }
    engine.destroy()
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
