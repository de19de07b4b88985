"""deepspeed.tp_model_init (DeepSpeed 0.19.8: record-only) and the merge into the config at the
next initialize (merge_tp_model_init_into_config's rules): fill what the config lacks, refuse
what conflicts, drop the record once used."""

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.autotp.model_init import TpModelInitError, _Record, merge_recorded_tp_model_init


@pytest.fixture(autouse=True)
def clean_record():
    _Record.args = None
    yield
    _Record.args = None


def test_records_and_returns_the_model_unchanged():
    model = nn.Linear(4, 4)
    weight = model.weight.clone()
    assert zeroshard.tp_model_init(model, tp_size=2, dtype=torch.float32, config={"x": 1}) is model
    assert torch.equal(model.weight, weight) and isinstance(model, nn.Linear)
    merged = merge_recorded_tp_model_init({"train_micro_batch_size_per_gpu": 1})
    assert merged["tensor_parallel"] == {"autotp_size": 2}
    assert merge_recorded_tp_model_init({"a": 1}) == {"a": 1}  # used once


def test_fills_missing_keys_and_refuses_conflicts():
    zeroshard.tp_model_init(nn.Linear(2, 2), 2, torch.bfloat16)
    config = {"bf16": {"enabled": True}, "tensor_parallel": {"preset_model": "llama"}}
    merged = merge_recorded_tp_model_init(config)
    assert merged["tensor_parallel"] == {"preset_model": "llama", "autotp_size": 2}
    assert "autotp_size" not in config["tensor_parallel"]  # the caller's dict is left alone
    for conflicting, message in [
        ({"tensor_parallel": {"autotp_size": 4}}, r"autotp_size=4 in the config, tp_model_init\(tp_size=2\)"),
        ({"fp16": {"enabled": True}}, r"tp_model_init\(dtype=torch.bfloat16\) but the config trains in torch.float16"),
        ({"tensor_parallel": {"tp": {"tp_size": 4}}}, r"tp.tp_size=4 in the config"),
        ({"tensor_parallel": {"dtype": "fp32"}}, r"tensor_parallel.dtype='fp32' in the config"),
    ]:
        zeroshard.tp_model_init(nn.Linear(2, 2), 2, torch.bfloat16)
        with pytest.raises(TpModelInitError, match=message):
            merge_recorded_tp_model_init(conflicting)


def test_a_second_call_must_agree():
    zeroshard.tp_model_init(nn.Linear(2, 2), 2, torch.float32)
    zeroshard.tp_model_init(nn.Linear(2, 2), 2, torch.float32)
    with pytest.raises(TpModelInitError, match="conflicting arguments across calls"):
        zeroshard.tp_model_init(nn.Linear(2, 2), 4, torch.float32)
    with pytest.raises(TpModelInitError, match=r"unexpected keyword argument\(s\) \['mesh'\]"):
        zeroshard.tp_model_init(nn.Linear(2, 2), 2, torch.float32, mesh=1)
