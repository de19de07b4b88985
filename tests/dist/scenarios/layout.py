"""Rank-side scenarios for tests/dist/sharding/test_layout.py: hybrid sharding (zeroshard/sharding/layout.py)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.reference import global_batches
from tests.dist.scenarios.common import Case, build_engine, engine_config, full_masters, train
from zeroshard.checkpoint.export import consolidate_fp32

HYBRID = {"zeroshard": {"shard_group_size": 2}}


def hybrid_case(stage: int, mode: str = "fp32", ga: int = 1, micro: int = 1, hybrid: bool = True) -> Case:
    return Case(
        stage=stage, mode=mode, micro=micro, ga=ga, steps=3, extra=dict(HYBRID) if hybrid else {},
        keep=("master",), variant="hybrid" if hybrid else "",
    )


def _groups_seen(log) -> list[tuple[str, str, tuple[int, ...], int]]:
    return [(r.op, r.tag, r.group, r.numel) for r in log.records]


def train_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Each case trained (full masters after every step); with the layout it ran on, the local
    master shards (replicas must hold the same ones) and every collective of the run."""
    results = []
    for case in cases:
        engine = build_engine(case)
        spec = engine.layout.dense
        with zeroshard.comm.recording() as log:
            out = train(engine, case)
        out["shard_ranks"] = spec.shard.ranks
        out["replicate_ranks"] = spec.replicate.ranks
        out["local_masters"] = [flat.master.detach().clone() for flat in engine.flats]
        out["collectives"] = _groups_seen(log)
        results.append(out)
    return results


def checkpoint_fragments(case: Case) -> dict[str, Any]:
    """Save after one step; the checkpoint consolidated without a process group must equal the
    engine's full masters (the index holds each element once, at shard-group offsets)."""
    engine = build_engine(case)
    train(engine, Case(**{**case.__dict__, "steps": 1, "keep": ()}))
    masters = full_masters(engine)
    root = [tempfile.mkdtemp(prefix="zeroshard-layout-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    engine.save_checkpoint(root[0], tag="t")
    consolidated = consolidate_fp32(root[0], "t") if dist.get_rank() == 0 else None
    return {"masters": masters, "consolidated": consolidated}


def bad_shard_group_size() -> str:
    """The error for a shard group size that does not divide the world."""
    case = hybrid_case(1)
    config = engine_config(case)
    config["zeroshard"] = {"shard_group_size": 3}
    try:
        zeroshard.initialize(model=torch.nn.Linear(2, 2), config=config)
    except ValueError as error:
        return str(error)
    return ""


def hybrid_resume(case: Case) -> dict[str, Any]:
    """Save a hybrid-sharded run after one step, continue it two steps; load the checkpoint
    into a fresh hybrid engine (other initial weights) and into a plain world-4 engine, and
    continue the hybrid one on the same batches."""
    rows = dist.get_world_size() * case.micro * case.ga
    batches = global_batches(case.seed, 3, rows)
    one_step = Case(**{**case.__dict__, "steps": 1, "keep": ()})
    two_steps = Case(**{**case.__dict__, "steps": 2, "keep": ("master",)})
    root = [tempfile.mkdtemp(prefix="zeroshard-layout-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)

    engine = build_engine(case)
    train(engine, one_step, batches=batches[:1])
    engine.save_checkpoint(root[0], tag="t")
    saved = full_masters(engine)
    expected = train(engine, two_steps, batches=batches[1:])["master"][-1]

    resumed = build_engine(Case(**{**case.__dict__, "seed": 1}))
    resumed.load_checkpoint(root[0], tag="t")
    loaded = full_masters(resumed)
    continued = train(resumed, two_steps, batches=batches[1:])["master"][-1]

    plain = build_engine(Case(**{**case.__dict__, "seed": 1, "extra": {}}))
    plain.load_checkpoint(root[0], tag="t")
    return {
        "saved": saved, "loaded": loaded, "expected": expected, "continued": continued,
        "plain_loaded": full_masters(plain), "plain_replicas": plain.layout.dense.replicate.size,
    }
