"""Smaller config and engine behaviours DeepSpeed 0.19's own unit tests assert (issue 30 item 8),
in one process: each test names the DeepSpeed test it follows."""

import pytest
import torch
from torch import nn

import zeroshard as deepspeed


class SimpleModel(nn.Module):
    def __init__(self, hidden_dim: int = 4) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_dim, hidden_dim)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, x, y):
        return self.loss(self.linear(x), y)


class PlainSGD(torch.optim.Optimizer):
    """DeepSpeed's SimpleOptimizer (tests/unit/simple_model.py): a user class ZeRO has not tested."""

    def __init__(self, params, lr: float = 0.11072018) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def batch():
    torch.manual_seed(1)
    return torch.randn(2, 4), torch.tensor([0, 3])


# --- zero_allow_untested_optimizer: DeepSpeed tests/unit/runtime/half_precision/test_fp16.py
# TestZeroAllowUntestedOptimizer (initialize refuses a client optimizer outside its list).

@pytest.mark.parametrize("stage", [0, 1, 2, 3])  # stage 0 too: a deliberate difference (the guide says why)
def test_untested_client_optimizer_is_refused_without_the_permission(stage):
    model = SimpleModel()
    config = {"train_batch_size": 2, "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": False}
    with pytest.raises(ValueError, match=r"PlainSGD is untested with ZeRO.*\"zero_allow_untested_optimizer\": true"):
        deepspeed.initialize(model=model, optimizer=PlainSGD(model.parameters()), config=config,
                             dist_init_required=False)
    with pytest.raises(ValueError, match="PlainSGD is untested"):  # a factory's result too
        deepspeed.initialize(model=SimpleModel(), optimizer=PlainSGD, config=config, dist_init_required=False)


def test_untested_client_optimizer_with_the_permission_steps_like_the_unwrapped_model():
    torch.manual_seed(0)
    model = SimpleModel()
    reference = SimpleModel()
    reference.load_state_dict(model.state_dict())
    config = {"train_batch_size": 2, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True}
    with pytest.warns(UserWarning, match="re-pointed your PlainSGD"):
        engine, *_ = deepspeed.initialize(model=model, optimizer=PlainSGD(model.parameters()), config=config,
                                          dist_init_required=False)
    engine.backward(engine(*batch()))
    engine.step()
    ref_opt = PlainSGD(reference.parameters())
    reference(*batch()).backward()
    ref_opt.step()
    for (name, got), want in zip(engine.module.named_parameters(), reference.parameters(), strict=True):
        # fp32 both ways, world 1: the same additions in the same order.
        torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=name)
