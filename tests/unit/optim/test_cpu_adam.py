"""zeroshard.optim.cpu_adam.DeepSpeedCPUAdam: DeepSpeed's signature, the fused CPU kernel, the same
update as torch's AdamW / Adam (checked against a float64 formula), one step count per step()."""

from __future__ import annotations

import inspect

import pytest
import torch

from zeroshard.ops.adam import DeepSpeedCPUAdam
from zeroshard.optim.build import build_host_optimizer


def test_signature_is_deepspeeds():
    names = list(inspect.signature(DeepSpeedCPUAdam.__init__).parameters)[1:]
    assert names == ["model_params", "lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad",
                     "adamw_mode", "fp32_optimizer_states"]


def reference(p0, grads, lr, betas, eps, wd, adamw):
    """Adam / AdamW in float64, written out."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        if adamw:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        mhat, vhat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p = p - lr * mhat / (vhat.sqrt() + eps)
    return p


@pytest.mark.parametrize("adamw", [True, False])
def test_update_matches_the_formula(adamw):
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(3)]
    p = p0.clone().requires_grad_()
    opt = DeepSpeedCPUAdam([p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, adamw_mode=adamw)
    assert opt.param_groups[0]["fused"] is True
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = reference(p0, grads, 1e-2, (0.9, 0.99), 1e-8, 0.1, adamw)
    # fp32 arithmetic over three steps of size ~lr: a few fp32 ulps of |p| ~ 1.
    torch.testing.assert_close(p.detach().double(), want, rtol=0, atol=2e-6)
    assert float(opt.state[p]["step"]) == 3.0
    assert opt.checkpoint_class == ("AdamW" if adamw else "Adam")


def test_refusals_name_the_argument():
    p = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"bias_correction=False"):
        DeepSpeedCPUAdam([p], bias_correction=False)
    opt = DeepSpeedCPUAdam([p])
    with pytest.raises(ValueError, match=r"fp16_param_groups"):
        opt.step(fp16_param_groups=[])


def test_the_engine_builds_it_for_an_offloaded_adam():
    groups = [{"params": [torch.zeros(4, requires_grad=True)]}]
    opt = build_host_optimizer("AdamW", {"lr": 3e-4, "weight_decay": 0.01}, groups, None)
    assert isinstance(opt, DeepSpeedCPUAdam) and opt.adamw_mode
    assert opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == 0.01
    fresh = [{"params": [torch.zeros(4, requires_grad=True)]}]
    adam = build_host_optimizer("Adam", {"adam_w_mode": False}, fresh, None)
    assert isinstance(adam, DeepSpeedCPUAdam) and not adam.adamw_mode
    sgd = build_host_optimizer("SGD", {"lr": 0.1}, [{"params": [torch.zeros(4, requires_grad=True)]}], None)
    assert type(sgd) is torch.optim.SGD
