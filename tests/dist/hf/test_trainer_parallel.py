"""AutoEP and ALST switched on through the Hugging Face Trainer, 2 CPU processes, through the
`deepspeed` alias (tests/dist/scenarios/trainer_parallel.py): per-step losses equal the same
Trainer run without DeepSpeed (DDP).

Tolerance: fp32. AutoEP moves tokens to the rank holding their expert (all-to-all) and sums
the expert gradients in another order; ALST computes attention on head slices and sums each
gradient over the sequence halves; DDP all-reduces buckets. The losses (3.9 and 4.8, float32
spacing 2.4e-7 and 4.8e-7) may differ in the last bits; 2e-6 allows a few spacings, far below
a step's change (~1e-2).
"""

from __future__ import annotations

import pytest

TIMEOUT_S = 600
ATOL = 2e-6


@pytest.fixture(scope="module")
def runs(hf_pool, tmp_path_factory):
    pool, alias = hf_pool
    # AutoEP first: ALST leaves sequence-parallel groups registered until its Trainer is gone.
    return pool.run("tests.dist.scenarios.trainer_parallel:trainer_parallel", alias,
                    str(tmp_path_factory.mktemp("trainer_parallel")), ["autoep", "alst"], timeout=TIMEOUT_S)


def _equal_losses(got: dict, reference: dict, label: str) -> None:
    got, reference = dict(got), dict(reference)
    assert got.pop("wrapper") == "Engine", f"{label}: not a zeroshard engine"
    assert reference.pop("wrapper") == "DistributedDataParallel", f"{label}: the reference must run without DeepSpeed"
    assert list(got) == [1, 2, 3] == list(reference), (label, got, reference)
    for step, value in got.items():
        assert abs(value - reference[step]) <= ATOL, (label, step, value, reference[step])
    assert len(set(got.values())) == 3, f"{label}: the losses moved"


@pytest.mark.parametrize("stage", [2, 3])
def test_autoep_through_the_trainer(runs, stage: int) -> None:
    for rank, out in enumerate(runs):
        autoep = out["autoep"]
        assert "AutoEPMoELayer" in autoep[f"stage{stage}_swapped"], "the expert_parallel section swapped the MoE blocks"
        _equal_losses(autoep[f"stage{stage}"], autoep["ddp"], f"rank {rank} AutoEP stage {stage}")


def test_alst_through_the_trainer(runs) -> None:
    for rank, out in enumerate(runs):
        alst = out["alst"]
        assert alst["stage3_sp"] == 2, "the engine's sequence-parallel group has both ranks"
        _equal_losses(alst["stage3"], alst["ddp"], f"rank {rank} ALST stage 3")
