"""The four ZeRO stages as policies on one mechanism (docs/design.md section 3).

Every stage uses the same units, flat buffers, shards, hooks and reductions; a stage only
answers the questions of the table below. Nothing else in the engine asks "which stage?".

| stage | full params kept | local gradient | reduced when | master + optimizer state |
|-------|------------------|----------------|--------------|--------------------------|
| 0     | yes              | full, persistent, accumulation dtype | boundary, all-reduce | full |
| 1     | yes              | full, persistent, accumulation dtype | boundary, all-reduce in place | shard |
| 2     | yes              | per unit, transient, accum. dtype | every backward, reduce-scatter | shard |
| 3     | no               | per unit, transient, accum. dtype | every backward, reduce-scatter | shard |

Reductions go through buckets of `reduce_bucket_size` elements that fill across units
(zeroshard/grads/reduce.py): a full bucket is reduced at once, asynchronously, while the
backward goes on; the rest at the end of the backward.

Stage 1 all-reduces (as stage 0) rather than reduce-scatters: it keeps the full local gradient
buffer anyway, so the all-reduce writes the reduced gradient back into it at no memory cost and
every rank holds the whole reduced gradient (`param.grad`, zeroshard/grads/views.py); the
optimizer reads its shard as a view. The price is bandwidth: an all-reduce moves twice a
reduce-scatter's bytes, so stage 1 moves 3 P per step (all-reduce, then the parameter
all-gather) where a reduce-scatter design moves 2 P.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    """One row of the table above.

    Attributes:
        stage: the ZeRO stage number.
        keep_full_params: full parameters stay materialised between uses (stages 0-2);
            at stage 3 a unit's full buffer exists only around its forward and backward.
        shard_optimizer: master weights and optimizer state exist for this rank's shard
            only; otherwise (stage 0) every rank steps on the whole flat buffer.
        reduce_every_backward: each backward reduces a unit's local gradient as soon as
            the unit is complete and keeps only the reduced shard (stages 2 and 3);
            otherwise the full local gradient accumulates until the boundary.
        scatter: the reduction leaves each rank its shard (reduce-scatter, stages 2-3);
            otherwise every rank gets the whole reduced gradient (all-reduce, stages 0-1).
    """

    stage: int
    keep_full_params: bool
    shard_optimizer: bool
    reduce_every_backward: bool
    scatter: bool


STAGE_POLICIES: dict[int, StagePolicy] = {
    0: StagePolicy(0, keep_full_params=True, shard_optimizer=False,
                   reduce_every_backward=False, scatter=False),
    1: StagePolicy(1, keep_full_params=True, shard_optimizer=True,
                   reduce_every_backward=False, scatter=False),
    2: StagePolicy(2, keep_full_params=True, shard_optimizer=True,
                   reduce_every_backward=True, scatter=True),
    3: StagePolicy(3, keep_full_params=False, shard_optimizer=True,
                   reduce_every_backward=True, scatter=True),
}


def stage_policy(stage: int) -> StagePolicy:
    try:
        return STAGE_POLICIES[stage]
    except KeyError:
        raise ValueError(
            f"zero_optimization.stage={stage}: must be 0, 1, 2 or 3."
        ) from None
