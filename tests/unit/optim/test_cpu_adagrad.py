"""`DeepSpeedCPUAdagrad`: DeepSpeed's signature, and the update of DeepSpeed's host kernel
(csrc/includes/cpu_adagrad.h: grad += wd * param; sum += grad^2; param -= lr * grad / (sqrt(sum) + eps))
checked against that formula in float64."""

import inspect

import pytest
import torch

from zeroshard.ops.adagrad import DeepSpeedCPUAdagrad


def test_signature_is_deepspeeds():
    # DeepSpeed 0.19.8 ops/adagrad/cpu_adagrad.py
    params = inspect.signature(DeepSpeedCPUAdagrad.__init__).parameters
    assert list(params)[1:] == ["model_params", "lr", "eps", "weight_decay", "amsgrad", "fp32_optimizer_states"]
    assert (params["lr"].default, params["eps"].default, params["weight_decay"].default) == (1e-2, 1e-10, 0)


def test_three_steps_follow_deepspeeds_formula():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64))
    grads = [torch.randn(64) for _ in range(3)]
    lr, eps, wd = 0.05, 1e-10, 0.1
    opt = DeepSpeedCPUAdagrad([p], lr=lr, eps=eps, weight_decay=wd)
    ref, total = p.detach().double().clone(), torch.zeros(64, dtype=torch.float64)
    for g in grads:
        p.grad = g.clone()
        opt.step()
        g64 = g.double() + wd * ref
        total += g64 * g64
        ref -= lr * g64 / (total.sqrt() + eps)
    # float32 parameters against the float64 formula: a few float32 roundings per step
    torch.testing.assert_close(p.detach().double(), ref, rtol=1e-6, atol=1e-6)


def test_amsgrad_is_refused():
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdagrad([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
