"""DeepSpeed's `deepspeed.utils.zero_to_fp32` functions and
`deepspeed.checkpoint.utils.clone_tensors_for_torch_save` over zeroshard (issue 24, item 1).

The reference for the consolidated weights is the trained fp32 module itself (one process,
stage 2, fp32: the module's parameters are the masters, so equality is exact); for
`clone_tensors_for_torch_save` it is what DeepSpeed 0.19.8's function returns for the same input
(run once in /tmp/dsvenv: an OrderedDict stays one, a view comes back with a storage of its own
size, non-tensors unchanged).
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zeroshard
from zeroshard.checkpoint.utils import clone_tensors_for_torch_save
from zeroshard.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(self.embed(x)))).pow(2).mean()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    torch.manual_seed(0)
    model = _Model()
    engine, *_ = zeroshard.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    })
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)))
        engine.step()
    save_dir = tmp_path_factory.mktemp("ckpt")
    engine.save_checkpoint(str(save_dir))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, save_dir


def test_fp32_state_dict_equals_the_trained_module(trained) -> None:
    reference, save_dir = trained
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert list(state) == list(reference)
    for name, value in reference.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], value), name
    without_frozen = get_fp32_state_dict_from_zero_checkpoint(save_dir, exclude_frozen_parameters=True)
    assert sorted(without_frozen) == sorted(k for k in reference if not k.startswith("frozen."))


def test_convert_writes_the_file_from_pretrained_reads(trained, tmp_path: Path) -> None:
    reference, save_dir = trained
    path = convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "out", safe_serialization=True)
    assert path == tmp_path / "out" / "model.safetensors"
    loaded = load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in reference.items()) and len(loaded) == len(reference)
    pt = convert_zero_checkpoint_to_fp32_state_dict(save_dir, tmp_path / "pt")
    assert pt.name == "pytorch_model.bin"
    assert all(torch.equal(t, reference[k]) for k, t in torch.load(pt, weights_only=True).items())


def test_load_state_dict_from_zero_checkpoint_fills_a_fresh_model(trained) -> None:
    reference, save_dir = trained
    torch.manual_seed(1)
    fresh = load_state_dict_from_zero_checkpoint(_Model(), save_dir)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in reference.items())


def test_clone_tensors_for_torch_save_as_deepspeed() -> None:
    base = torch.arange(6.0)
    out = clone_tensors_for_torch_save(OrderedDict(a=[base[:2], (base[2:4], 3)], b="x"))
    assert type(out) is OrderedDict and out["b"] == "x" and out["a"][1][1] == 3
    assert torch.equal(out["a"][0], torch.tensor([0.0, 1.0])) and torch.equal(out["a"][1][0], torch.tensor([2.0, 3.0]))
    assert out["a"][0].untyped_storage().size() == 8  # 2 floats: its own storage, not the 6-float base
    out["a"][0][0] = 5.0
    assert base[0] == 0.0
