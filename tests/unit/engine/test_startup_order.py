"""Start-up order: cast before moving, one unit's full flat at a time at stage 3 (issue 14).

On a GPU the engine used to move the whole fp32 model to the device, then cast and flatten it,
so stage 3 needed the whole fp32 model on one GPU at start-up. On CPU there is no second device
to watch, so this test checks the order of the operations that decide it: the parameters are
cast before anything moves; each flat buffer is built while the flats before it hold only their
shards (stage 3); `module.to(device)` comes last, when every trainable parameter is already a
view of a flat (built on the device) and only buffers and frozen parameters are left to move.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.engine.engine import Engine
from zeroshard.sharding.flat import FlatParamGroup


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.LayerNorm(32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.register_buffer("offset", torch.zeros(32))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return (self.norm(x) + self.frozen(x) + self.offset).float().pow(2).mean()


@pytest.mark.parametrize("stage", [0, 3])
def test_cast_then_one_flat_at_a_time_then_move(monkeypatch, stage: int) -> None:
    events: list[tuple] = []
    built: list[FlatParamGroup] = []
    real_init, real_cast = FlatParamGroup.__init__, Engine._cast_module

    def flat_init(self, *args, **kwargs):
        # Bytes of full flat buffers alive when this one starts: the earlier flats' (0 at stage 3).
        alive = sum(f.full.untyped_storage().nbytes() for f in built)
        dtypes = {p.dtype for p in args[2]}
        real_init(self, *args, **kwargs)
        built.append(self)
        events.append(("flat", alive, dtypes, self.full.untyped_storage().nbytes()))

    def cast(self, model):
        real_cast(self, model)
        events.append(("cast",))

    model = _Model()
    real_to = model.to

    def move(*args, **kwargs):
        storages = {f.full.untyped_storage().data_ptr() for f in built}
        trainable = [p for p in model.parameters() if p.requires_grad]
        events.append(("to", all(p.untyped_storage().data_ptr() in storages for p in trainable)))
        return real_to(*args, **kwargs)

    monkeypatch.setattr(FlatParamGroup, "__init__", flat_init)
    monkeypatch.setattr(Engine, "_cast_module", cast)
    monkeypatch.setattr(model, "to", move)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "bf16": {"enabled": True},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = zeroshard.initialize(model=model, config=config)

    kinds = [e[0] for e in events]
    assert kinds[0] == "cast" and kinds[-1] == "to" and kinds.count("to") == 1, kinds
    flats = [e for e in events if e[0] == "flat"]
    assert len(flats) == len(engine.flats) >= 5
    for _, alive, dtypes, _ in flats:
        assert dtypes == {torch.bfloat16}  # cast before the flat (and the device) sees them
        if stage == 3:
            assert alive == 0  # the earlier units keep only their shards
    assert events[-1] == ("to", True)  # only buffers and frozen parameters are left to move
    if stage == 0:
        assert flats[-1][1] == sum(f[3] for f in flats[:-1])  # stages 0-2 keep every flat whole
    loss = engine(torch.randn(2, 32))  # and the engine trains
    engine.backward(loss)
    engine.step()
