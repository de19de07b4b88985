"""MoE figures of AutoEP layers in one process: a tiny DeepSeek-V3 with aux-loss-free
balancing. The load sums to tokens x k, nothing drops (dropless), and the bias norm is the
norm of the router's bias buffer. A forward under torch.no_grad() in train mode between
backward and step feeds neither the balancer's counts nor the figures (only training forwards:
train mode and grad enabled)."""

from __future__ import annotations

import math

import pytest
import torch

import zeroshard

pytest.importorskip("transformers")

BATCH, SEQ, K, STEPS = 2, 6, 2, 2


def test_autoep_load_and_bias_norm():
    from tests.unit.moe.autoep_models import tiny_deepseek_v3

    torch.manual_seed(0)
    model = tiny_deepseek_v3()
    config = {"train_micro_batch_size_per_gpu": BATCH, "steps_per_print": STEPS,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "expert_parallel": {"enabled": True, "autoep_size": 1, "load_balance_coeff": 1e-2}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    layers = [m for m in engine.module.modules() if getattr(m, "_is_autoep_layer", False)]
    for _ in range(STEPS):
        ids = torch.randint(0, 48, (BATCH, SEQ))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        counted = [layer.tokens_per_expert.clone() for layer in layers]
        with torch.no_grad():  # train mode, no grad: not a training forward, counted nowhere
            engine(input_ids=torch.randint(0, 48, (BATCH, SEQ)))
        assert all(torch.equal(layer.tokens_per_expert, c) for layer, c in zip(layers, counted, strict=True))
        engine.step()
    figures = engine.figures.summary()
    layers = sorted({key.split("/")[1] for key in figures if key.startswith("moe/") and key.count("/") == 2})
    assert layers == ["model.layers.1.mlp", "model.layers.2.mlp"], layers
    for name in layers:
        load = [figures[f"moe/{name}/expert{j}_tokens"] for j in range(8)]
        assert sum(load) == BATCH * SEQ * K, (name, load)
        assert figures[f"moe/{name}/dropped"] == 0
        bias = engine.module.get_submodule(name).router.e_score_correction_bias
        assert bias.abs().sum() > 0, "the balancer should have moved the bias"
        assert math.isclose(figures[f"moe/{name}/bias_norm"], float(bias.double().norm()), rel_tol=1e-6)
    assert figures["moe/all_to_all_ms"] == 0.0  # autoep_size 1: no exchange
