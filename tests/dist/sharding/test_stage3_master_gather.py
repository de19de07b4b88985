"""Stage 3 with 16-bit parameters and fp32 masters keeps no 16-bit parameter shard: each gather
casts the master into this rank's slot of the full buffer (flat.py's [Note: gathering from the
master]).

- Bytes held between steps drop by exactly 2 per element of this rank's shard (the bf16/fp16
  shard no longer kept: 1,244 bytes on each of 2 ranks for TinyModel), counted as
  benchmarks/gpu_check/held_bytes.py counts them (every live storage once), as what is freed
  with the engine. Measured against the same engine built as before the change (a kept shard).
- Training is bitwise the same as with the kept shard (losses, norms, masters, module
  parameters: the gather casts the same master the publish cast before), and follows the
  single-process fp32-master reference within the mode's conformance tolerance
  (tests/dist/reference.py's TOLERANCES: the engine sums per micro-batch and per rank, the
  reference over the global batch).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.reference import check_against_reference, reference_for, world_losses
from tests.dist.scenarios.common import Case
from tests.dist.scenarios.master_gather import both_paths

WORLD = 2


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_stage3_gathers_from_the_master_and_holds_two_bytes_less_per_parameter(dist_pool, mode: str) -> None:
    ranks = dist_pool(WORLD).run(both_paths, mode, timeout=600)
    for rank, out in enumerate(ranks):
        now, before = out["held"]["master"], out["held"]["shard"]
        assert now["sharded_flats"] > 0 and now["param_shards"] == 0, now
        assert before["param_shards"] == before["sharded_flats"], before
        assert now["shard_numel"] == before["shard_numel"]
        # The one difference between the two engines is the 16-bit shard (2 bytes each).
        assert before["held"] - now["held"] == 2 * now["shard_numel"], (rank, before["held"], now["held"])
        assert now["losses"] == before["losses"]
        new, old = out["trained"]["master"], out["trained"]["shard"]
        for key in ("losses", "grad_norms", "master", "module", "initial_master", "initial_module", "grad0"):
            assert _equal(new[key], old[key]), f"{mode} rank {rank}: {key} differs from the kept-shard path"

    case = Case(stage=3, mode=mode, steps=3)
    per_rank = [[out["trained"]["master"]] for out in ranks]
    check_against_reference(
        per_rank[0][0], reference_for(case, WORLD), mode, case.settings, world_losses(per_rank, 0), case.label
    )
