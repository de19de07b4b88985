"""`initialize(..., mesh_param=(dp, sp))`, DeepSpeed's way to ask for data x sequence parallelism
(issue 30 item 4): the argument exists with DeepSpeed's name, and bad meshes are refused with the
cause and the fix. The multi-rank behaviour (it trains as the config's sizes do) is in
tests/dist/sequence/test_sequence_engine.py."""

import inspect

import pytest
import torch
from torch import nn

import zeroshard as deepspeed
from zeroshard.config.error import DeepSpeedConfigError

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _initialize(mesh, config=None, **kwargs):
    model = nn.Linear(4, 4)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), dist_init_required=False,
                                config=config or CONFIG, mesh_param=mesh, **kwargs)


def test_signature_matches_deepspeed_order():
    names = list(inspect.signature(deepspeed.initialize).parameters)
    # DeepSpeed 0.19: ..., collate_fn, config, mesh_param, config_params.
    assert names[names.index("config"):] == ["config", "mesh_param", "config_params"]


def test_a_one_rank_mesh_trains():
    engine, *_ = _initialize((1, 1))
    assert engine.config.data_parallel_size == 1 and engine.config.sequence_parallel_size == 1
    loss = engine(torch.ones(2, 4)).sum()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize("mesh, words", [
    ((1, 2), ["mesh_param=(1, 2)", "2", "1 ranks run"]),
    ((2.0, 1), ["two positive integers"]),
    ((1,), ["(data_parallel_size, sequence_parallel_size)"]),
    ((0, 1), ["two positive integers"]),
])
def test_bad_meshes_are_refused(mesh, words):
    with pytest.raises(DeepSpeedConfigError) as info:
        _initialize(mesh)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_mesh_and_config_must_agree():
    with pytest.raises(DeepSpeedConfigError, match="sequence_parallel_size=2 in the config, but mesh_param gives 1"):
        _initialize((1, 1), config={**CONFIG, "sequence_parallel_size": 2})


def test_mesh_and_mpu_are_exclusive():
    from zeroshard.sequence import parallel_state_sp

    with pytest.raises(DeepSpeedConfigError, match="either mpu= or mesh_param="):
        _initialize((1, 1), mpu=parallel_state_sp)
