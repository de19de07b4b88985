"""DeepSpeed engine methods in one process: `scale` outside fp16, `backward`'s return value,
`step()` inside `no_sync()`, and `global_samples` through a checkpoint."""

import json

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from tests.dist.checkpoint_craft import rewrite_index


class SimpleModel(nn.Module):
    """DeepSpeed's unit-test model: a linear layer and a cross-entropy loss."""

    def __init__(self, hidden_dim: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.loss(self.linear(x), y)


def make_engine(**config):
    torch.manual_seed(0)
    model = SimpleModel()
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      dist_init_required=False, config={**base, **config})
    return engine


def batch():
    return torch.randn(2, 4), torch.tensor([0, 3])


def test_scale_without_loss_scaling_is_the_loss_itself():
    engine = make_engine()
    loss = engine(*batch())
    assert engine.scale(loss) is loss
    with pytest.raises(ValueError, match="scalar tensor with a grad_fn"):
        engine.scale(torch.tensor(1.0))


def test_backward_returns_the_loss_divided_by_the_accumulation_steps():
    engine = make_engine()
    loss = engine(*batch())
    returned = engine.backward(loss)
    assert float(returned.detach()) == float(loss.detach()) / 2
    loss = engine(*batch())
    assert engine.backward(loss, scale_wrt_gas=False) is loss


def test_step_inside_no_sync_is_an_error():
    engine = make_engine()
    with engine.no_sync():
        engine.backward(engine(*batch()))
        with pytest.raises(RuntimeError, match="inside no_sync"):
            engine.step()


def test_global_samples_survive_a_checkpoint(tmp_path):
    engine = make_engine()
    for _ in range(4):
        engine.backward(engine(*batch()))
        engine.step()
    assert (engine.global_steps, engine.global_samples) == (2, 8)
    engine.save_checkpoint(tmp_path)
    fresh = make_engine()
    fresh.load_checkpoint(tmp_path)
    assert fresh.global_samples == 8
    # A checkpoint written before global_samples was kept: DeepSpeed's steps x train batch.
    tag_dir = tmp_path / "global_step2"
    rewrite_index(tag_dir, lambda index: index["counters"].pop("global_samples"))
    assert "global_samples" not in json.loads((tag_dir / "index.json").read_text())["counters"]
    older = make_engine(train_micro_batch_size_per_gpu=3)
    older.load_checkpoint(tmp_path)
    assert older.global_samples == 2 * 3 * 2


def test_coalesce_grad_reduction_needs_zero_1_to_3_and_managed_accumulation():
    with pytest.raises(NotImplementedError, match="stage 1, 2 or 3"):
        with make_engine().coalesce_grad_reduction():
            pass
    unmanaged = make_engine(managed_gradient_accumulation=False, zero_optimization={"stage": 1})
    with pytest.raises(RuntimeError, match="managed_gradient_accumulation false"):
        with unmanaged.coalesce_grad_reduction():
            pass
    engine = make_engine(zero_optimization={"stage": 1})
    with engine.no_sync(), pytest.raises(RuntimeError, match="cannot be nested"):
        with engine.coalesce_grad_reduction():
            pass
