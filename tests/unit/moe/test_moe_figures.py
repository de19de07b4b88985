"""MoE figures in one process: per-layer expert load sums to tokens x k, dropped routes are
what the capacity cut, and the auxiliary loss is the mean the router returned."""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard.moe.layer import MoE

HIDDEN, EXPERTS, K, ROWS, GA, STEPS = 8, 4, 2, 12, 2, 4


class TwoMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
        # Capacity factor 1 and a small minimum: some experts overflow and drop routes.
        self.moes = nn.ModuleList(
            [MoE(HIDDEN, expert, num_experts=EXPERTS, k=K, capacity_factor=1.0, min_capacity=1) for _ in range(2)]
        )

    def forward(self, x, y):
        h = self.embed(x)
        aux = h.new_zeros(())
        for moe in self.moes:
            out, l_aux, _ = moe(h)
            h, aux = h + out, aux + l_aux
        return F.mse_loss(h.sum(-1), y) + 0.01 * aux


def test_expert_load_sums_to_tokens_times_k_and_drops_match_the_capacity(caplog):
    torch.manual_seed(0)
    model = TwoMoE()
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": GA, "steps_per_print": STEPS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    # The reference: the gate's own outputs, seen by a hook of the test's.
    seen = {i: {"counts": torch.zeros(EXPERTS, dtype=torch.float64), "dropped": 0, "aux": []} for i in range(2)}

    def watch(i):
        def hook(module, args, output):
            aux, capacity, _, _, _, _, counts = output
            seen[i]["counts"] += counts.double()
            seen[i]["dropped"] += sum(max(0, int(c) - int(capacity)) for c in counts)
            seen[i]["aux"].append(float(aux.detach()))
        return hook

    for i, moe in enumerate(model.moes):
        moe.deepspeed_moe.gate.register_forward_hook(watch(i))
    with caplog.at_level(logging.INFO, logger="zeroshard"):
        for _ in range(STEPS * GA):
            engine.backward(engine(torch.randn(ROWS, 5), torch.randn(ROWS)))
            engine.step()
    figures = engine.figures.summary()
    total_dropped = 0.0
    for i in range(2):
        name = f"moes.{i}"
        load = torch.tensor([figures[f"moe/{name}/expert{j}_tokens"] for j in range(EXPERTS)], dtype=torch.float64)
        # Per optimizer step: GA micro-batches of ROWS tokens, k routes each (exact integers).
        assert float(load.sum()) == ROWS * GA * K
        torch.testing.assert_close(load, seen[i]["counts"] / STEPS, rtol=0, atol=0)
        assert figures[f"moe/{name}/min"] == float(load.min())
        assert figures[f"moe/{name}/max"] == float(load.max())
        assert math.isclose(figures[f"moe/{name}/cv"], float(load.std(unbiased=False) / load.mean()), rel_tol=1e-12)
        assert figures[f"moe/{name}/dropped"] == seen[i]["dropped"] / STEPS
        total_dropped += figures[f"moe/{name}/dropped"]
        # fp32 accumulation of 8 fp32 values against their float64 mean.
        assert math.isclose(figures[f"moe/{name}/aux_loss"], sum(seen[i]["aux"]) / len(seen[i]["aux"]), rel_tol=1e-6)
    assert total_dropped > 0, "the capacity should have dropped routes in this setup"
    assert sum(r.getMessage().startswith("moe moes.") for r in caplog.records) == 2


def test_no_moe_layers_no_figures():
    model = nn.Linear(4, 1)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    assert not engine.figures.moe.enabled
