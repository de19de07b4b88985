"""The reduce bucket default per backend, and the engine's data loader pinning on CUDA (issue 14)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.comm import collectives as comm
from zeroshard.grads.reduce import GLOO_BUCKET_NUMEL, default_bucket_numel


def _engine(zero: dict, training_data=None) -> zeroshard.Engine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)), nn.Linear(8, 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 2, **zero},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config, training_data=training_data)
    return engine


@pytest.mark.parametrize(
    ("backend", "set_by_user", "expected"),
    [
        ("nccl", None, "largest flat"),
        ("cpu:gloo,cuda:nccl", None, "largest flat"),
        ("gloo", None, GLOO_BUCKET_NUMEL),
        ("", None, GLOO_BUCKET_NUMEL),  # a world of one: no collective, the value is moot
        ("nccl", 1000, 1000),  # what the config says always wins
        ("gloo", 1000, 1000),
    ],
)
def test_engine_picks_the_bucket_size_for_its_backend(monkeypatch, backend, set_by_user, expected) -> None:
    monkeypatch.setattr(comm, "backend_name", lambda group: backend)
    engine = _engine({} if set_by_user is None else {"reduce_bucket_size": set_by_user})
    largest = max(flat.padded_numel for flat in engine.flats)
    assert engine._grads.reducer.bucket_numel == (largest if expected == "largest flat" else expected)


def test_default_bucket_numel_on_nccl_is_one_flat() -> None:
    engine = _engine({})
    sizes = sorted(flat.padded_numel for flat in engine.flats)
    assert len(set(sizes)) > 1  # the flats differ, so "the largest" is a real choice
    # Units: Linear(8, 16) (144 elements), Linear(16, 8) (136), the root (Linear(8, 8) + Linear(8, 1): 81).
    assert default_bucket_numel("nccl", engine.flats) == sizes[-1] == 8 * 16 + 16
    assert default_bucket_numel("gloo", engine.flats) == GLOO_BUCKET_NUMEL


class _Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.full((8,), float(i)), torch.zeros(1)


@pytest.mark.parametrize(("device", "pinned"), [("cpu", False), ("cuda", True)])
def test_data_loader_pins_batches_on_cuda(device: str, pinned: bool) -> None:
    """Pinned host batches on CUDA, so `batch.to(device, non_blocking=True)` is asynchronous.
    (The CUDA case only builds the loader: iterating it needs a GPU.)"""
    engine = _engine({})
    engine.device = torch.device(device)
    loader = engine._make_dataloader(_Rows(), None)
    assert loader.pin_memory is pinned
