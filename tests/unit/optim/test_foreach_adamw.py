"""AdamW over a list of tensors at once (optim/foreach_adamw.py), fused AdamW's choice, and the
placement of `step` when optimizer state is loaded (issue 14)."""

from __future__ import annotations

import math

import pytest
import torch

import zeroshard
from zeroshard.optim.build import build_optimizer, fused_allowed
from zeroshard.optim.foreach_adamw import adamw_foreach

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SIZES = (257, 64, 3)


def _float64_adamw(p0: torch.Tensor, grads: list[torch.Tensor], store: torch.dtype) -> torch.Tensor:
    """AdamW's formula in float64, the parameter stored in `store` after every step (as the
    optimizer stores it) and the moments kept exact."""
    p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - LR * WD)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
        p = (p - LR * m_hat / (v_hat.sqrt() + EPS)).to(store).double()
    return p


def _run(dtype: torch.dtype, state_dtype: torch.dtype | None, steps: int = 5):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    start = [p.clone() for p in params]
    grads = [[torch.randn(n, generator=g).to(dtype) for n in SIZES] for _ in range(steps)]
    states: list[dict] = [{} for _ in params]
    for step_grads in grads:
        adamw_foreach(params, step_grads, states, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                      state_dtype=state_dtype)
    return params, start, grads, states


def test_fp32_is_bitwise_torch_adamw_per_tensor() -> None:
    params, start, grads, states = _run(torch.float32, None)
    for i, p0 in enumerate(start):
        q = p0.clone()
        ref = torch.optim.AdamW([q], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
        for step_grads in grads:
            q.grad = step_grads[i].clone()
            ref.step()
        assert torch.equal(params[i], q)
        assert torch.equal(states[i]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        assert float(states[i]["step"]) == 5.0 and states[i]["step"].device.type == "cpu"


@pytest.mark.parametrize(
    ("dtype", "state_dtype", "rtol"),
    [
        # fp32 arithmetic over 5 steps: a few fp32 ulps of the parameter.
        (torch.float32, None, 1e-6),
        # bf16 storage: the float64 reference rounds to bf16 too; an fp32 intermediate may round
        # the other way, one bf16 ulp (2^-7 relative).
        (torch.bfloat16, torch.float32, 2**-7),
    ],
)
def test_matches_a_float64_formula(dtype, state_dtype, rtol) -> None:
    params, start, grads, states = _run(dtype, state_dtype)
    for i, p0 in enumerate(start):
        expected = _float64_adamw(p0, [gs[i] for gs in grads], dtype)
        torch.testing.assert_close(params[i].double(), expected, rtol=rtol, atol=1e-7)
        assert params[i].dtype == dtype
        assert states[i]["exp_avg"].dtype == (state_dtype or dtype)


class _CudaLike:
    """Stands in for a CUDA tensor: fused_allowed only asks where and what it is."""

    def __init__(self, floating: bool = True) -> None:
        self.is_cuda, self._floating = True, floating

    def is_floating_point(self) -> bool:
        return self._floating


def test_fused_only_for_cuda_masters() -> None:
    assert fused_allowed([{"params": [_CudaLike(), _CudaLike()]}])
    assert not fused_allowed([{"params": [_CudaLike(), torch.zeros(2)]}])
    assert not fused_allowed([{"params": [_CudaLike(floating=False)]}])
    assert not fused_allowed([{"params": []}])
    cpu = build_optimizer("AdamW", {"lr": 1e-3}, [{"params": [torch.zeros(2, requires_grad=True)]}])
    assert not cpu.param_groups[0]["fused"]  # CPU masters: torch's per-tensor loop, as the references use


@pytest.mark.parametrize(("fused", "step_moved"), [(False, False), (True, True)])
def test_loaded_step_follows_the_optimizer(monkeypatch, fused: bool, step_moved: bool) -> None:
    """A loaded `step` stays on the host for torch's default AdamW and goes to the masters'
    device for fused AdamW (whose kernels read it there); elementwise state always goes there.
    On CPU both places are the CPU, so the test watches which tensors are sent to the device."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = zeroshard.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}},
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=1e-3, fused=fused),
    )
    flat = engine.flats[0]
    moved: list[int] = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        moved.append(self.dim())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    state = {"step": torch.tensor(3.0), "exp_avg": torch.zeros_like(flat.master),
             "exp_avg_sq": torch.zeros_like(flat.master)}
    flat.load_optimizer_state(engine.optimizer, state)
    monkeypatch.undo()
    assert moved.count(1) == 2
    assert (0 in moved) is step_moved
    assert math.isclose(float(engine.optimizer.state[flat.master]["step"]), 3.0)
