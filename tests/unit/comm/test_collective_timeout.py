"""zeroshard.collective_timeout_s and init_distributed(timeout=...) (issue 13 item 8).

The value reaches torch's init_process_group (captured here with a stand-in); that a
timeout then fails with a CollectiveError naming the collective is tests/dist/comm/test_fault_injection.py.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from zeroshard.config.schema import ConfigError, requested_collective_timeout_s
from zeroshard.launch import distributed
from zeroshard.resolve import resolve_config

CONFIG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


@pytest.fixture
def captured_init(monkeypatch):
    """init_process_group's keyword arguments, with torchrun's variables set and no group made."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(distributed, "default_backend", lambda: "gloo")
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
                       "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(key, value)
    return calls


def test_default_is_ten_minutes_not_torchs_thirty(captured_init):
    distributed.init_distributed()
    assert captured_init[0]["timeout"] == timedelta(seconds=600) == timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)


@pytest.mark.parametrize("given", [7, 7.0, timedelta(seconds=7)])
def test_init_distributed_takes_seconds_or_a_timedelta(captured_init, given):
    distributed.init_distributed(timeout=given)
    assert captured_init[0]["timeout"] == timedelta(seconds=7)


def test_initialize_passes_the_configs_timeout(captured_init, tmp_path):
    config = {**CONFIG, "zeroshard": {"collective_timeout_s": 42}}
    zeroshard.initialize(model=nn.Linear(2, 2), config=config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    zeroshard.initialize(model=nn.Linear(2, 2), config=str(path))
    assert [c["timeout"] for c in captured_init] == [timedelta(seconds=42)] * 2


def test_bad_timeout_is_a_config_error():
    with pytest.raises(ConfigError, match="zeroshard.collective_timeout_s"):
        resolve_config({**CONFIG, "zeroshard": {"collective_timeout_s": 0}})
    assert requested_collective_timeout_s({"zeroshard": {"collective_timeout_s": -1}}) is None
    assert resolve_config(CONFIG).zeroshard.collective_timeout_s == DEFAULT_COLLECTIVE_TIMEOUT_S
