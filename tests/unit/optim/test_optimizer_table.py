"""One table of optimizer names (zeroshard/config/optimizers.py) that the config, the builder
and the memory estimate read: each row the config accepts is built (by optim/build.py, or the
engine's Muon), and the state the memory estimate counts for it is what the built optimizer
really keeps after a step."""

from __future__ import annotations

import pytest
import torch

from zeroshard.config.optimizers import OPTIMIZERS, UNSUPPORTED_OPTIMIZERS
from zeroshard.config.schema import ConfigError
from zeroshard.optim.build import build_optimizer
from zeroshard.optim.muon.optimizer import Muon
from zeroshard.resolve import resolve_config
from zeroshard.tools.memory import optimizer_state_count

PARAMS = {"Adam": {}, "AdamW": {}, "SGD": {"momentum": 0.9}, "Muon": {}}


def _elementwise_states(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> int:
    state = optimizer.state[param]
    return sum(1 for v in state.values() if isinstance(v, torch.Tensor) and v.shape == param.shape)


@pytest.mark.parametrize("name", [kind.name for kind in OPTIMIZERS.values()])
def test_every_accepted_name_is_built_and_its_state_counted(name: str) -> None:
    config = {"train_batch_size": 1, "optimizer": {"type": name, "params": PARAMS[name]}}
    resolve_config(config)  # the config accepts it
    param = torch.nn.Parameter(torch.randn(8, 8))
    if OPTIMIZERS[name.lower()].built_by == "torch":
        optimizer = build_optimizer(name, PARAMS[name], [{"params": [param]}])
    else:
        optimizer = Muon([{"params": [param], "use_muon": True}], lr=0.02)
    param.grad = torch.randn(8, 8)
    optimizer.step()
    assert _elementwise_states(optimizer, param) == optimizer_state_count(name, PARAMS[name])


def test_sgd_without_momentum_keeps_no_state() -> None:
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = build_optimizer("SGD", {}, [{"params": [param]}])
    param.grad = torch.ones(4)
    optimizer.step()
    assert _elementwise_states(optimizer, param) == optimizer_state_count("SGD", {}) == 0


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_OPTIMIZERS.values()))
def test_deepspeeds_other_optimizers_are_refused_by_name(name: str) -> None:
    with pytest.raises(ConfigError, match="recognised DeepSpeed optimizer, not supported by zeroshard"):
        resolve_config({"train_batch_size": 1, "optimizer": {"type": name, "params": {}}})


def test_the_builder_refuses_what_it_does_not_build() -> None:
    with pytest.raises(ConfigError, match=r"optimizer.type='Muon': not built here. Use one of Adam, AdamW, SGD"):
        build_optimizer("Muon", {}, [{"params": [torch.nn.Parameter(torch.zeros(2))]}])
