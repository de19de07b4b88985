"""The demo GPT with MoE feed-forward layers (GPTConfig.moe_*), in one process."""

from __future__ import annotations

import math

import pytest
import torch

from zeroshard.demo.cli import build_parser, torchrun_command
from zeroshard.models import build_gpt
from zeroshard.moe.layer import MoE


def test_moe_gpt_has_deepspeed_layout_and_adds_the_aux_loss() -> None:
    torch.manual_seed(0)
    model = build_gpt("tiny", moe_num_experts=4, moe_k=2)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks)
    names = {n for n, _ in model.named_parameters()}
    assert "blocks.0.mlp.deepspeed_moe.gate.wg.weight" in names
    assert "blocks.0.mlp.deepspeed_moe.experts.deepspeed_experts.3.c_fc.weight" in names
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    ce = torch.nn.functional.cross_entropy(logits.float().view(-1, 256), idx.reshape(-1))
    aux = sum(b.aux_loss for b in model.blocks)
    assert loss.item() == pytest.approx((ce + 0.01 * aux).item(), abs=1e-6)
    # At init the gate is near uniform, so each top-2 aux loss is about 1 (its balanced value).
    assert aux.item() == pytest.approx(len(model.blocks), rel=0.2)
    assert math.isfinite(loss.item())


def test_moe_gpt_learns() -> None:
    torch.manual_seed(0)
    model = build_gpt("tiny", moe_num_experts=4, moe_k=2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 256, (4, 32))
    losses = []
    for _ in range(20):
        _, loss = model(idx, idx)  # predict the same byte: learnable in a few steps
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_demo_cli_passes_moe_options_to_the_training_processes(tmp_path) -> None:
    args = build_parser().parse_args(["--moe-experts", "4", "--moe-ep-size", "2", "--moe-k", "2"])
    command = torchrun_command(args, 2, tmp_path)
    assert command[command.index("--moe-experts") :][:6] == ["--moe-experts", "4", "--moe-ep-size", "2", "--moe-k", "2"]
    dense = torchrun_command(build_parser().parse_args([]), 2, tmp_path)
    assert "--moe-experts" not in dense
