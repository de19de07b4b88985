"""Floating buffers keep their own dtype in bf16/fp16 mode (a rotary `inv_freq` must not become
bf16), as in DeepSpeed 0.19; `data_types.buffer_dtype` casts them on purpose."""

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.config.schema import ConfigError
from zeroshard.resolve import resolve_config


class Rotary(nn.Module):
    """A linear layer whose input is rotated by fixed frequencies (a rotary embedding's buffer)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self.register_buffer("steps", torch.arange(4))  # an integer buffer: never cast
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = self.steps[: x.shape[0], None].float() * self.inv_freq  # fp32 whatever x is
        rotated = torch.cat([x[:, ::2] * angles.cos() - x[:, 1::2] * angles.sin(),
                             x[:, ::2] * angles.sin() + x[:, 1::2] * angles.cos()], dim=-1)
        return self.proj(rotated.to(x.dtype))


def engine_for(precision: dict):
    torch.manual_seed(0)
    model = Rotary()
    engine, *_ = zeroshard.initialize(
        model=model, model_parameters=model.parameters(), dist_init_required=False,
        config={**precision, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
    )
    return engine


EXPECTED_INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))


@pytest.mark.parametrize(
    "precision, param_dtype",
    [({"bf16": {"enabled": True}}, torch.bfloat16),
     ({"fp16": {"enabled": True}}, torch.float16),
     ({"bf16": {"enabled": True}, "torch_autocast": {"enabled": True}}, torch.bfloat16)],
)
def test_floating_buffers_keep_their_dtype(precision, param_dtype):
    engine = engine_for(precision)
    module = engine.module
    assert module.proj.weight.dtype == param_dtype
    assert module.inv_freq.dtype == torch.float32
    assert torch.equal(module.inv_freq, EXPECTED_INV_FREQ)  # not rounded through bf16/fp16
    assert module.steps.dtype == torch.int64
    out = engine(torch.randn(4, 8))
    engine.backward(out.float().sum())
    engine.step()
    assert torch.equal(module.inv_freq, EXPECTED_INV_FREQ)
    assert engine.precision_plan.as_dict()["buffers"] == "own dtype"


def test_buffer_dtype_casts_floating_buffers_only():
    engine = engine_for({"bf16": {"enabled": True}, "data_types": {"buffer_dtype": "bf16"}})
    assert engine.module.inv_freq.dtype == torch.bfloat16
    assert torch.equal(engine.module.inv_freq, EXPECTED_INV_FREQ.to(torch.bfloat16))
    assert engine.module.steps.dtype == torch.int64
    assert engine.precision_plan.as_dict()["buffers"] == "bf16"
    engine.backward(engine(torch.randn(4, 8)).float().sum())
    engine.step()


def test_buffer_dtype_is_validated():
    assert resolve_config({"data_types": {"buffer_dtype": "float16"}}).precision_plan.buffer_dtype == torch.float16
    with pytest.raises(ConfigError, match=r'^data_types\.buffer_dtype="int8": unknown dtype'):
        resolve_config({"data_types": {"buffer_dtype": "int8"}})
