"""The accumulation state (zeroshard/grads/accumulation.py) through a real engine in one process:
the phase after each part of a training loop, DeepSpeed's counters against their formulas, and
the reduced gradient of an accumulation against a float64 reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.grads.accumulation import Phase


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 5)
        self.second = nn.Linear(5, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).pow(2).mean()


def _engine(stage: int, accumulation: int = 2, micro_batch: int = 4):
    torch.manual_seed(0)
    model = _Model()
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    return engine


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=generator) for _ in range(count)]


@pytest.mark.parametrize(("stage", "first_backward_phase"), [(1, Phase.LOCAL), (2, Phase.REDUCED)])
def test_phases_through_an_accumulation(stage: int, first_backward_phase: Phase) -> None:
    """Stages 0-1 keep a non-boundary backward's gradients local; stages 2-3 reduce every one."""
    engine = _engine(stage)
    state = engine.accumulation
    seen_in_backward: list[Phase] = []
    # A parameter's tensor hook runs inside the backward (the loss's own hook would run before
    # the backward reaches the module's outputs, where it starts).
    engine.module.first.weight.register_hook(lambda g: seen_in_backward.append(state.phase))
    assert state.phase is Phase.STEPPED
    for micro, x in enumerate(_batches(2)):
        loss = engine(x)
        assert state.phase is Phase.FORWARD
        engine.backward(loss)
        expected = first_backward_phase if micro == 0 else Phase.REDUCED
        assert state.phase is expected
        assert state.unreduced == (expected is Phase.LOCAL)
        engine.step()
        assert state.phase is Phase.STEPPED
    assert seen_in_backward == [Phase.BACKWARD, Phase.BACKWARD]
    with engine.no_sync():
        engine.backward(engine(_batches(1)[0]))
    assert state.phase is Phase.LOCAL and state.unreduced
    engine.zero_grad()
    assert not state.unreduced


def test_counters_follow_deepspeeds_formulas() -> None:
    """k = 3, 7 micro-steps: the boundary is every third; global_samples is a train batch
    (micro-batch x k x world size 1) per boundary step; a repeated step() counts nothing."""
    k, micro_steps = 3, 7
    engine = _engine(2, accumulation=k)
    boundaries = []
    for x in _batches(micro_steps):
        engine.backward(engine(x))
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        engine.step()  # no backward since: changes nothing
    assert boundaries == [(i + 1) % k == 0 for i in range(micro_steps)]
    assert engine.micro_steps == micro_steps
    assert engine.global_steps == micro_steps // k
    assert engine.global_samples == (micro_steps // k) * 4 * k
    assert engine.skipped_steps == 0
    engine.global_steps = 11  # a checkpoint load sets them
    assert engine.accumulation.global_steps == 11


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reduced_gradient_of_an_accumulation_matches_float64(stage: int) -> None:
    """The reduced gradient after k = 2 micro-steps is the mean of the micro-steps' gradients,
    computed here in float64 from a copy of the initial weights. Tolerance: rtol 1e-5,
    atol 1e-7 (fp32 forward and backward against float64, and one fp32 add and divide)."""
    engine = _engine(stage)
    torch.manual_seed(0)
    reference = _Model().double()
    batches = _batches(2)
    for x in batches:
        reference(x.double()).backward()
    expected = {n: p.grad / 2 for n, p in reference.named_parameters()}
    engine.backward(engine(batches[0]))
    engine.step()  # not the boundary: no optimizer step
    engine.backward(engine(batches[1]))
    assert engine.is_gradient_accumulation_boundary()
    for flat in engine.flats:
        reduced = flat.grads.reduced
        assert reduced is not None
        start, length = flat.master_range()
        full = torch.zeros(flat.padded_numel, dtype=torch.float64)
        for name, offset, numel in zip(flat.names, flat.offsets, flat.numels, strict=True):
            full[offset : offset + numel] = expected[name].reshape(-1)
        torch.testing.assert_close(reduced.double(), full[start : start + length], rtol=1e-5, atol=1e-7)
