"""`engine.metrics()` in one process: the figures of the last step against a float64 reference
computed from the same model and batches, producers' figures merged in, and nothing invented
where the engine could not see it (a plain `loss.backward()` has no loss to report)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import zeroshard


def make(model, **config):
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "gradient_clipping": 0.0}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(),
                                      dist_init_required=False, config={**base, **config})
    return engine


def batches():
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(2, 4, generator=gen), torch.randn(2, 3, generator=gen)) for _ in range(2)]


def test_metrics_match_a_float64_reference():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model).double()
    engine = make(model)
    assert engine.metrics() == {"loss": None, "lr": None, "loss_scale": None, "grad_norm": None,
                                "samples": 0, "step": 0}
    seen = []
    for x, y in batches():
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        seen.append(float(loss.detach()))
        ref_loss = nn.functional.mse_loss(reference(x.double()), y.double()) / 2
        ref_loss.backward()
    figures = engine.metrics()
    # fp32 forward vs float64: rel 1e-6 covers a few float32 roundings of numbers near 1.
    assert figures["loss"] == pytest.approx(math.fsum(seen) / 2, rel=1e-6)
    ref_norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in reference.parameters()))
    assert figures["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert figures["lr"] == 0.05 and figures["loss_scale"] == 1.0
    assert (figures["samples"], figures["step"]) == (4, 1)
    assert all(type(v) in (int, float) for v in figures.values())


def test_producers_add_their_figures():
    engine = make(nn.Linear(4, 3))
    engine.training_figures.register("moe", lambda: {"dropped_tokens": 3, "aux_loss": torch.tensor(0.25)})
    figures = engine.metrics()
    assert figures["moe/dropped_tokens"] == 3 and figures["moe/aux_loss"] == 0.25
    engine.training_figures.unregister("moe")
    assert "moe/dropped_tokens" not in engine.metrics()
    engine.training_figures.register("", lambda: {"step_ms": 12.5})
    assert engine.metrics()["step_ms"] == 12.5


def test_plain_backward_has_no_loss_to_report():
    engine = make(nn.Linear(4, 3))
    for x, y in batches():
        nn.functional.mse_loss(engine(x), y).backward()
        engine.step()
    figures = engine.metrics()
    assert figures["loss"] is None and figures["step"] == 1 and figures["grad_norm"] > 0
