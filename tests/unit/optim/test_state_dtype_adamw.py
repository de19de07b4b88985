"""StateDtypeAdamW: torch's AdamW arithmetic with moments in a dtype of their own."""

import torch

import zeroshard
from zeroshard.optim.state_dtype_adamw import StateDtypeAdamW


def test_matches_torch_adamw_bitwise_in_fp32():
    # Same formula, same fp32 operations: every element must be bitwise equal.
    torch.manual_seed(0)
    p = torch.randn(257)
    q = p.clone()
    ref = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    ours = StateDtypeAdamW([q], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    for _ in range(5):
        g = torch.randn(257)
        p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    assert torch.equal(p, q)
    assert torch.equal(ref.state[p]["exp_avg_sq"], ours.state[q]["exp_avg_sq"])


def test_non_decoupled_matches_torch_adam():
    torch.manual_seed(1)
    p = torch.randn(64)
    q = p.clone()
    ref = torch.optim.Adam([p], lr=1e-2, weight_decay=0.05)
    ours = StateDtypeAdamW([q], lr=1e-2, weight_decay=0.05, decoupled=False)
    for _ in range(3):
        g = torch.randn(64)
        p.grad, q.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    # Adam's L2 term goes through a different but equivalent op order: 1 fp32 ulp per step.
    torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_bf16_params_keep_fp32_state():
    p = torch.randn(32).to(torch.bfloat16)
    opt = StateDtypeAdamW([p], lr=1e-3, state_dtype=torch.float32)
    p.grad = torch.randn(32).to(torch.bfloat16)
    opt.step()
    assert p.dtype == torch.bfloat16
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert opt.state[p]["exp_avg_sq"].dtype == torch.float32


def test_engine_uses_fp32_state_beside_bf16_masters():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
        "zero_optimization": {"stage": 1},
    }
    engine, optimizer, _, _ = zeroshard.initialize(model=model, config=config)
    loss = engine(torch.randn(2, 4)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    master = engine.flats[0].master
    assert master.dtype == torch.bfloat16
    assert optimizer.state[master]["exp_avg"].dtype == torch.float32
