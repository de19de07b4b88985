"""Rank-side scenarios for tests/dist/test_layout.py: hybrid sharding (zeroshard/layout.py)."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
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
