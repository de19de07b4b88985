"""Global micro-batch k (zeroshard/engine/micro_batches.py): the same samples and the same random
numbers at every world size, which the deterministic reduction's promise needs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from zeroshard.engine.micro_batches import MicroBatchSampler, micro_batch_rng, micro_batch_seed

SAMPLES, MICRO, TRAIN_BATCH = 37, 2, 16  # 8 micro-batches per step


def by_global_index(world: int, **kwargs) -> dict[int, list[int]]:
    """{k: samples of global micro-batch k} read back from every rank's sampler: rank r's j-th
    micro-batch is k = j * world + r."""
    out = {}
    for rank in range(world):
        sampler = MicroBatchSampler(SAMPLES, MICRO, TRAIN_BATCH, world, rank, **kwargs)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        for j, batch in enumerate(batches):
            out[j * world + rank] = batch
    return out


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_micro_batch_k_holds_the_same_samples_at_every_world_size(shuffle, drop_last):
    expected = by_global_index(1, shuffle=shuffle, drop_last=drop_last, seed=5)
    # Whole train batches per epoch: 48 samples padded, 32 with drop_last.
    assert len(expected) * MICRO == (32 if drop_last else 48)
    for world in (2, 4, 8):
        assert by_global_index(world, shuffle=shuffle, drop_last=drop_last, seed=5) == expected


def test_the_order_is_distributed_samplers_permutation():
    """The same permutation of the epoch as DistributedSampler draws (seed + epoch), cut into
    micro-batches; the padding repeats the epoch's first samples."""
    for epoch in (0, 3):
        reference = DistributedSampler(range(SAMPLES), num_replicas=1, rank=0, shuffle=True, seed=5)
        reference.set_epoch(epoch)
        order = list(reference)
        sampler = MicroBatchSampler(SAMPLES, MICRO, TRAIN_BATCH, 1, 0, seed=5)
        sampler.set_epoch(epoch)
        flat = [i for batch in sampler for i in batch]
        assert flat == order + order[: 48 - SAMPLES]


def test_distributed_samplers_micro_batches_change_with_the_world_size():
    """Why the mode has its own sampler: DistributedSampler deals samples, not micro-batches."""
    def micro_batches(world: int) -> set[tuple[int, ...]]:
        out = set()
        for rank in range(world):
            samples = list(DistributedSampler(range(32), num_replicas=world, rank=rank, shuffle=False))
            out |= {tuple(samples[i : i + MICRO]) for i in range(0, len(samples), MICRO)}
        return out

    assert micro_batches(1) != micro_batches(2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match=r"train_batch_size=12: must be a multiple of micro_batch_size \(2\) x "
                                          r"num_replicas \(4\)"):
        MicroBatchSampler(SAMPLES, 2, 12, 4, 0)
    with pytest.raises(ValueError, match=r"dataset_size=10: with drop_last, an epoch needs at least one train batch"):
        MicroBatchSampler(10, 2, 16, 2, 0, drop_last=True)


def test_micro_batch_seeds():
    seeds = {micro_batch_seed(s, k, f) for s in (0, 1) for k in range(64) for f in range(2)}
    assert len(seeds) == 256  # no two alike
    assert all(0 <= s < 2**63 for s in seeds)
    assert micro_batch_seed(7, 12, 1) == micro_batch_seed(7, 12, 1)


def test_micro_batch_rng_draws_from_its_seed_and_restores_the_stream():
    torch.manual_seed(123)
    outside = torch.rand(3)
    torch.manual_seed(123)
    with micro_batch_rng(42, torch.device("cpu")):
        first = torch.rand(4)
    with micro_batch_rng(42, torch.device("cpu")):
        again = torch.rand(4)
    assert torch.equal(first, again)
    assert torch.equal(torch.rand(3), outside)  # the program's own stream went on untouched
    assert torch.equal(first, torch.rand(4, generator=torch.Generator().manual_seed(42)))


def test_an_epoch_can_start_at_a_step():
    """A replay (or resume) at another world size reads the same micro-batches from step 2 on."""
    whole = by_global_index(1, seed=5)
    for world in (1, 2, 8):
        for rank in range(world):
            sampler = MicroBatchSampler(SAMPLES, MICRO, TRAIN_BATCH, world, rank, seed=5)
            sampler.set_start_step(2)
            batches = list(sampler)
            assert len(batches) == len(sampler) == 8 // world
            assert batches == [whole[k] for k in range(16 + rank, 24, world)]
    with pytest.raises(ValueError, match=r"step=3: an epoch here has 3 steps"):
        MicroBatchSampler(SAMPLES, MICRO, TRAIN_BATCH, 1, 0).set_start_step(3)
