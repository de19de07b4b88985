"""Benchmarks that build DDP or several engines in one process destroy the process group only
after those are gone (issue 36 item 6).

A DDP model (or FSDP2 module, or DeepSpeed engine) alive when the group is destroyed is freed
later, where its Reducer joins a gloo worker thread while holding the GIL: benchmarks/interleaved.py
hung at exit for ten minutes that way. Each rank here runs interleaved.py's rank body (DDP and a
zeroshard stage, one step of the tiny GPT) and peers_worker.py's `run` with DDP, with
`destroy_process_group` replaced by a probe that lists what is still alive of those kinds at that
moment (the pool's own group stays). Before: DistributedDataParallel and Engine in
interleaved.py's list, DistributedDataParallel in peers_worker.py's. After: nothing, and the
script's own check (`benchmarks/process_group.py close_group`) passes.

Every other benchmark and example that builds DDP or several engines was read for the same
(docs/notes for issue 36 list them); the ones that destroy their own group go through close_group.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
def _alive() -> list[str]:
    """What the probe sees: DDP models and zeroshard engines still in memory (no gc pass first:
    an object only a cycle keeps lives until the next collection, which may be at exit)."""
    from zeroshard.engine.engine import Engine

    return sorted(type(o).__name__ for o in gc.get_objects()
                  if isinstance(o, torch.nn.parallel.DistributedDataParallel | Engine))


def teardown_probe(json_path: str) -> dict[str, list[list[str]]]:
    saved_path, saved_threads, saved_local = list(sys.path), torch.get_num_threads(), os.environ.get("LOCAL_RANK")
    sys.path.insert(0, str(BENCHMARKS))
    import interleaved
    import peers_device
    import peers_worker

    seen: dict[str, list[list[str]]] = {"interleaved": [], "peers_worker": []}
    real_destroy, real_init = dist.destroy_process_group, peers_device.init_group
    current = ["interleaved"]
    dist.destroy_process_group = lambda *a, **k: seen[current[0]].append(_alive())
    peers_device.init_group = lambda *a, **k: torch.device("cpu")  # the pool's group is there already
    peers_worker.init_group = peers_device.init_group
    try:
        args = argparse.Namespace(world_size=2, mode="fp32", device="cpu", engines="ddp,s2", model="tiny",
                                  global_batch=4, steps=1, warmup=0, zeroshard_root=str(ROOT), json=json_path,
                                  config_extra="{}")
        interleaved._rank_main(dist.get_rank(), args, 0)
        current[0] = "peers_worker"
        peers_worker.run(argparse.Namespace(engine="ddp", device="cpu", world_size=2, model="tiny", global_batch=4,
                                            steps=1, warmup=0, seed=1, mode="fp32", stage=None, reshard=None,
                                            profile_out=None))
    finally:
        dist.destroy_process_group, peers_device.init_group = real_destroy, real_init
        sys.path[:] = saved_path
        torch.set_num_threads(saved_threads)
        if saved_local is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved_local
    return seen


def test_benchmarks_destroy_the_group_after_ddp_and_engines(dist_pool, tmp_path) -> None:
    for rank, seen in enumerate(dist_pool(2).run(teardown_probe, str(tmp_path / "interleaved.json"), timeout=180)):
        assert seen == {"interleaved": [[]], "peers_worker": [[]]}, (rank, seen)
    assert (tmp_path / "interleaved.json").is_file()
