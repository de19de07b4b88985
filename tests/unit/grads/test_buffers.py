"""A flat's gradient buffers (zeroshard/grads/buffers.py) through one accumulation and its
reduction, without communication: which buffer holds what, and when one is reused or freed.
The expected values are the gradients themselves (exact: copies and one fp32 add)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.sharding.test_partition import BF16, BF16_ROLE, FP32, FP32_ROLE, SHAPES, build


def _grads(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def _full(flat, grads: list[torch.Tensor]) -> torch.Tensor:
    """The flat-layout vector of `grads`, zeros in the padding."""
    out = torch.zeros(flat.padded_numel)
    for offset, numel, g in zip(flat.offsets, flat.numels, grads, strict=True):
        out[offset : offset + numel] = g.reshape(-1)
    return out


def test_stage_1_reduces_in_place_and_reuses_the_local_buffer(monkeypatch) -> None:
    """Stages 0-1: the local buffer becomes the whole reduced gradient (no second buffer); after
    the step it is the local buffer again, and the next accumulation overwrites, not adds."""
    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=1, stage=1, role=FP32_ROLE)
    grads = flat.grads
    first, second = _grads(1), _grads(2)
    for index, g in enumerate(first):
        grads.accumulate(index, g)
    local, in_place = grads.begin_reduction()
    assert in_place and grads.local is None and grads.reduced_full is local
    assert torch.equal(local, _full(flat, first))
    assert torch.equal(grads.reduced, flat.shard_of(local))  # the master's range: this rank's shard
    storage = local.untyped_storage().data_ptr()

    grads.clear_reduced()  # after the step
    assert grads.reduced is None and grads.reduced_full is None
    assert grads.local.untyped_storage().data_ptr() == storage
    grads.accumulate(0, second[0])
    expected = torch.zeros(flat.padded_numel)
    expected[: flat.numels[0]] = second[0].reshape(-1)
    assert torch.equal(grads.settled_local(), expected)  # stale values never leak in


def test_stage_2_copies_out_frees_the_local_buffer_and_accumulates_the_shard(monkeypatch) -> None:
    """Stages 2-3: the reducer copies the local gradient out and it is freed; the reduced shard
    is its own buffer in the accumulation dtype (fp32 under bf16), zeroed by `drop`."""
    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=0, stage=2, role=BF16_ROLE)
    grads = flat.grads
    first = [g.to(BF16) for g in _grads(3)]
    for index, g in enumerate(first):
        grads.accumulate(index, g)
        grads.accumulate(index, g)
    local, in_place = grads.begin_reduction()
    assert not in_place and local.dtype == FP32
    assert torch.equal(local, 2 * _full(flat, [g.float() for g in first]))  # exact: x + x in fp32
    grads.end_reduction()
    assert grads.local is None
    reduced = grads.reduced_buffer()
    assert reduced.dtype == FP32 and reduced.numel() == flat.shard_numel and not reduced.any()
    reduced.add_(flat.shard_of(local))  # what the reducer writes
    flat.master.grad = reduced
    grads.host_landed = 3
    grads.drop()
    assert flat.master.grad is None and grads.host_landed == 0
    assert grads.reduced is reduced and not reduced.any()


def test_released_after_the_step_on_an_accelerator(monkeypatch) -> None:
    """`release_after_step` (the default off the CPU): the step's `clear_reduced` frees every
    reduced buffer, the local one included when the reduction ran in place, and the next
    accumulation starts from a new buffer holding only the new gradients."""
    flat, _, _ = build(monkeypatch, SHAPES, world_size=2, rank=1, stage=1, role=FP32_ROLE)
    grads = flat.grads
    assert grads.release_after_step is False  # the CPU keeps and reuses its buffer
    grads.release_after_step = True
    for index, g in enumerate(_grads(1)):
        grads.accumulate(index, g)
    local, in_place = grads.begin_reduction()
    assert in_place
    grads.clear_reduced()
    assert grads.reduced is None and grads.reduced_full is None and grads.local is None
    second = _grads(2)
    grads.accumulate(0, second[0])
    expected = torch.zeros(flat.padded_numel)
    expected[: flat.numels[0]] = second[0].reshape(-1)
    assert torch.equal(grads.settled_local(), expected)


@pytest.mark.parametrize("stage", [1, 2])
def test_local_gradient_sums_what_arrived_and_is_zero_elsewhere(monkeypatch, stage: int) -> None:
    """The local buffer is never zero-filled up front: the first gradient of a parameter is
    copied in, later ones are added, and reading it zeroes what no gradient reached (and the
    padding) — also after the buffer is restarted holding stale values (stage 1 keeps it)."""
    flat, _, _ = build(monkeypatch, SHAPES, 7, 0, stage=stage, role=BF16_ROLE)  # 300 -> padded 301
    g1 = torch.randn(7, 5, dtype=BF16)
    g2 = torch.randn(7, 5, dtype=BF16)
    g3 = torch.randn(16, 16, dtype=BF16)
    for _ in range(2):  # the second round reuses (stage 1) or reallocates (stage 2) the buffer
        flat.grads.accumulate(0, g1)
        flat.grads.accumulate(0, g2)
        flat.grads.accumulate(3, g3)
        local = flat.grads.settled_local()
        assert local.dtype == FP32  # the accumulation dtype, not the bf16 gradient's
        expected = torch.zeros(301)
        expected[:35] = g1.float().reshape(-1) + g2.float().reshape(-1)  # summed in fp32
        expected[41:297] = g3.float().reshape(-1)
        assert torch.equal(local, expected)  # exact: one fp32 add of two bf16 values
        local.fill_(123.0)  # stale values that a restart must not leak into the next sum
        flat.grads.end_reduction()
