"""Sequence parallelism in the engine: a tiny Llama (built from a config) trained 2 steps
(SGD with momentum, clipping active) through ALST with sequence parallelism at ZeRO stages 1-3
equals plain PyTorch data parallelism over the same global batch: each step's loss
(token-weighted over the sequence ranks, prompts of different lengths ignored), the first
step's gradients and every parameter afterwards.

World 2: SP 2 (one data replica). World 4: SP 2 x DP 2 (groups on different samples).
Tolerance (fp32): gradients and parameters atol 1e-6, rtol 1e-5, losses atol 1e-5: the same
numbers, but each gradient is summed over sequence slices and ranks instead of over the whole
sequence at once (observed differences are below 1e-7).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist.scenarios.sequence_engine import cross_checkpoint, train

TIMEOUT_S = 600
STAGES = [1, 2, 3]


@pytest.mark.parametrize("world, sp, via", [(2, 2, "mpu"), (4, 2, "mpu"), (4, 2, "config"), (4, 2, "mesh")])
def test_sequence_parallel_training_equals_data_parallel(dist_pool, world: int, sp: int, via: str) -> None:
    """`via`: the groups come from initialize(mpu=), from the config's sequence_parallel_size and
    data_parallel_size, or from DeepSpeed's initialize(mesh_param=(dp, sp)) (the last two at
    stage 2 only: the same path otherwise)."""
    stages = STAGES if via == "mpu" else [2]
    runs = dist_pool(world).run(train, stages, sp, via=via, timeout=TIMEOUT_S)
    for rank, results in enumerate(runs):
        for result in results:
            label = f"world {world} sp {sp} rank {rank} stage {result['stage']}"
            first = rank - rank % sp
            assert result["groups"] == (list(range(first, first + sp)), list(range(rank % sp, world, sp))), label
            torch.testing.assert_close(
                torch.tensor(result["losses"]), torch.tensor(result["ref_losses"]), atol=1e-5, rtol=0,
                msg=lambda m, s=label: f"{s}: losses: {m}",
            )
            for name, ref in result["ref_grads"].items():
                torch.testing.assert_close(
                    result["grads"][name], ref, atol=1e-6, rtol=1e-5,
                    msg=lambda m, s=label, n=name: f"{s}: grad {n}: {m}",
                )
            for name, ref in result["ref_params"].items():
                torch.testing.assert_close(
                    result["params"][name], ref, atol=1e-6, rtol=1e-5, msg=lambda m, s=label, n=name: f"{s}: {n}: {m}"
                )


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("save_sp, load_sp", [(2, 1), (1, 2)])
def test_checkpoints_cross_sequence_parallelism(dist_pool, tmp_path, stage: int, save_sp: int, load_sp: int) -> None:
    """A checkpoint saved with sequence parallelism loads without it, and the other way round:
    the same parameters and momentum (bitwise: the dense shards are the same either way)."""
    directory = str(tmp_path / "ckpt")
    for rank, out in enumerate(dist_pool(2).run(cross_checkpoint, stage, save_sp, load_sp, directory,
                                                timeout=TIMEOUT_S)):
        for kind in ("params", "momentum"):
            for name, saved in out["saved"][kind].items():
                assert saved is not None and torch.equal(out["loaded"][kind][name], saved), (rank, kind, name)
