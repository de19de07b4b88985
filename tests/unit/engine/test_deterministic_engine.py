"""The deterministic reduction's engine side in one process (zeroshard/engine/deterministic.py):
the calls that would take a micro-batch's gradient out of the summation tree are refused with the
reason and the fix, the calls a DeepSpeed loop or Accelerate makes are accepted, the engine's own
loader deals whole micro-batches, and `param.grad` (stages 0-1) is the reduced gradient after the
boundary backward and None during the accumulation, as without the mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import zeroshard
from zeroshard.engine.micro_batches import MicroBatchSampler


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 5)
        self.second = nn.Linear(5, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x))).pow(2).mean()


def _engine(stage: int = 0, steps: int = 2, **kwargs):
    torch.manual_seed(0)
    model = _Model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": steps,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "zeroshard": {"deterministic_reduction": True},
    }
    engine, _, loader, _ = zeroshard.initialize(model=model, config=config, **kwargs)
    return engine, loader


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(i))


def test_calls_that_leave_the_tree_are_refused():
    engine, _ = _engine(stage=1)
    with pytest.raises(RuntimeError, match=r"engine\.no_sync\(\) with zeroshard\.deterministic_reduction: every "
                                           r"micro-batch's gradient is one leaf.*Drop the no_sync\(\) block"):
        engine.no_sync()
    with pytest.raises(RuntimeError, match=r"engine\.coalesce_grad_reduction\(\) with zeroshard\.deterministic"):
        with engine.coalesce_grad_reduction():
            pass
    with pytest.raises(RuntimeError, match=r"engine\.backward\(scale_wrt_gas=False\) with zeroshard\."
                                           r"deterministic_reduction.*Call engine\.backward\(loss\)"):
        engine.backward(engine(_x(0)), scale_wrt_gas=False)
    with pytest.raises(RuntimeError, match=r"set_gradient_accumulation_boundary\(True\) at micro-step 0.*This "
                                           r"micro-step is not the boundary: call it with False"):
        engine.set_gradient_accumulation_boundary(True)


def test_accelerates_loop_is_accepted():
    """Accelerate sets the boundary before every backward, to what the counting gives."""
    engine, _ = _engine(stage=2)
    for i in range(4):
        boundary = i % 2 == 1
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(engine(_x(i)))
        engine.step()
    assert engine.global_steps == 2


def test_two_backwards_in_one_micro_step_are_refused_at_the_boundary():
    engine, _ = _engine(stage=2)
    engine.backward(engine(_x(0)))
    engine.backward(engine(_x(1)))  # a second leaf in micro-step 0
    engine.step()
    with pytest.raises(RuntimeError, match=r"3 micro-batch gradient\(s\) reduced in this optimizer step \(since "
                                           r"the last step or zero_grad\), but gradient_accumulation_steps is 2"):
        engine.backward(engine(_x(2)))


@pytest.mark.parametrize("stage", [0, 1])
def test_param_grad_is_the_reduced_gradient_at_the_boundary_only(stage):
    engine, _ = _engine(stage=stage)
    engine.backward(engine(_x(0)))
    assert all(p.grad is None for p in engine.module.parameters())  # a micro-step of the accumulation
    engine.step()
    engine.backward(engine(_x(1)))
    grads = {n: p.grad for n, p in engine.module.named_parameters()}
    # The reference: each micro-batch's gradient / 2, summed (a tree of two leaves), in fp32.
    torch.manual_seed(0)
    model = _Model()
    leaves = []
    for i in range(2):
        model.zero_grad()
        model(_x(i)).backward()
        leaves.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name, grad in grads.items():
        assert grad is not None, name
        assert torch.equal(grad, leaves[0][name] / 2 + leaves[1][name] / 2), name
    engine.step()


def test_the_engines_loader_deals_whole_micro_batches():
    data = TensorDataset(torch.arange(20, dtype=torch.float32))
    _, loader = _engine(training_data=data)
    assert isinstance(loader.batch_sampler, MicroBatchSampler)
    # 20 samples padded to whole train batches (8 = 4 x 2 steps x 1 rank): 24, in 6 micro-batches of 4.
    batches = [b[0].long().tolist() for b in loader]
    assert len(loader) == len(batches) == 6
    order = [i for b in batches for i in b]
    assert sorted(order[:20]) == list(range(20)) and order[20:] == order[:4]  # padded with the first ones
