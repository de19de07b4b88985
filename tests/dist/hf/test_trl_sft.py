"""TRL's SFTTrainer trains on zeroshard through the `deepspeed` alias, 2 CPU processes, and TRL's
ZeRO-3 generation helper works on the engine (tests/dist/scenarios/trl_sft.py).

Tolerance for the losses: fp32; DDP all-reduces bucketed gradients while stage 3 reduce-
scatter flat shards, so sums may run in another order and the losses (about 3.6, float32
spacing 2.4e-7) may differ in the last bits: 2e-6 allows several spacings, far below a step's
change (~1e-2). Generation is greedy on the same weights: the tokens must be equal.
"""

from __future__ import annotations

import pytest
import torch

TIMEOUT_S = 600
ATOL = 2e-6


@pytest.fixture(scope="module")
def runs(hf_pool, tmp_path_factory):
    pool, alias = hf_pool
    return pool.run("tests.dist.scenarios.trl_sft:sft_runs", alias, str(tmp_path_factory.mktemp("sft")),
                    timeout=TIMEOUT_S)


def test_sft_losses_equal_sft_without_deepspeed(runs) -> None:
    stage = 3
    for rank, out in enumerate(runs):
        reference, got = dict(out["losses"]["ddp"]), dict(out["losses"][f"stage{stage}"])
        assert got.pop("wrapper") == "Engine" and reference.pop("wrapper") == "DistributedDataParallel", rank
        assert list(got) == [1, 2, 3, 4] == list(reference), (rank, got, reference)
        for step, value in got.items():
            assert abs(value - reference[step]) <= ATOL, (rank, stage, step, value, reference[step])
        assert len(set(got.values())) == 4, "the losses moved"


def test_unwrap_model_for_generation_at_stage3(runs) -> None:
    lengths = set()
    for rank, out in enumerate(runs):
        gen = out["generation"]
        assert gen["has_offload"], "engine.optimizer.parameter_offload (what TRL's remove_hooks reads)"
        assert gen["hooks_removed"] and gen["hooks_back"], (rank, gen)
        assert torch.equal(gen["generated"], gen["expected"]), (rank, gen["generated"], gen["expected"])
        assert gen["freed_again"], "the gathered parameters are freed when the context exits"
        assert gen["engine_loss"] == pytest.approx(gen["plain_loss"], abs=ATOL), rank
        lengths.add(gen["generated"].shape[1])
    assert len(lengths) == 2, "each rank generated a different number of tokens"
