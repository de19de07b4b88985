"""DeepSpeed's ZeRO-3 parameter attributes on a stage-3 engine's parameters, 2 ranks (issue 42
item 1; zeroshard/zero/param_attributes.py).

- `ds_id`: on every trainable parameter of a stage-3 engine, unique, the same on both ranks, in
  `parameters()` order; none at stage 1 or on a frozen parameter (so `hasattr(p, "ds_id")` tells
  a ZeRO-3 parameter apart, as in DeepSpeed); a parameter built under `zero.Init` is numbered
  there and keeps its id through `initialize`. Before: no parameter had one, and DeepSpeed-style
  code (`p.ds_shape if hasattr(p, "ds_id") else p.shape`) read the freed parameters as shape (0,).
- `ds_persist`: true exactly for the resident unit's parameters.
- `partition_numel()`: the ranks' counts sum to `ds_numel` (zeroshard's shards are slices of a
  unit's flat buffer: counts differ between ranks, no padding).
- `ds_summary()`: DeepSpeed 0.19.8's keys; `ds_tensor` absent (the guide's table says why).
"""

from __future__ import annotations

import torch
from torch import nn

import zeroshard

# DeepSpeed 0.19.8 runtime/zero/partition_parameters.py, ds_summary().
DEEPSPEED_SUMMARY_KEYS = ["id", "status", "numel", "ds_numel", "shape", "ds_shape", "requires_grad", "grad_shape",
                          "persist", "active_sub_modules", "ds_tensor.shape"]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))  # 72 elements per unit
        self.head = nn.Linear(8, 3)  # the root unit: 27 elements, resident below the threshold
        self.frozen = nn.Parameter(torch.ones(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum() + self.frozen.sum()


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 30}}


def attributes() -> dict:
    torch.manual_seed(0)
    with zeroshard.zero.Init(config_dict_or_path=_config(3)):
        built = Model()
    ids_at_init = {n: getattr(p, "ds_id", None) for n, p in built.named_parameters()}
    engine, *_ = zeroshard.initialize(model=built, config=_config(3))
    params = dict(engine.module.named_parameters())
    out = {
        "ids_at_init": ids_at_init,
        "ids": {n: getattr(p, "ds_id", None) for n, p in params.items()},
        "persist": {n: p.ds_persist for n, p in params.items() if hasattr(p, "ds_id")},
        "partition_numel": {n: p.partition_numel() for n, p in params.items() if hasattr(p, "ds_id")},
        "ds_numel": {n: p.ds_numel for n, p in params.items() if hasattr(p, "ds_id")},
        "summary_keys": list(params["blocks.0.weight"].ds_summary()),
        "summary_debug_id": params["blocks.0.weight"].ds_summary(use_debug_name=True)["id"],
        "has_ds_tensor": any(hasattr(p, "ds_tensor") for p in params.values()),
        # DeepSpeed's way of reading a parameter's full shape, between gathers.
        "deepspeed_style_shapes": {n: tuple(p.ds_shape) if hasattr(p, "ds_id") else tuple(p.shape)
                                   for n, p in params.items()},
    }
    torch.manual_seed(0)
    plain, *_ = zeroshard.initialize(model=Model(), config=_config(1))
    out["stage1_has_ds_id"] = any(hasattr(p, "ds_id") for p in plain.module.parameters())
    return out


def test_stage3_parameters_carry_deepspeeds_attributes(dist_pool) -> None:
    ranks = dist_pool(2).run(attributes, timeout=120)
    first = ranks[0]
    assert ranks[1]["ids"] == first["ids"], "ds_id must be the same on every rank"
    trainable = [n for n in first["ids"] if n != "frozen"]
    assert first["ids"]["frozen"] is None
    ids = [first["ids"][n] for n in trainable]
    assert all(isinstance(i, int) for i in ids) and ids == sorted(set(ids)), ids
    assert {n: first["ids_at_init"][n] for n in trainable} == {n: first["ids"][n] for n in trainable}
    assert first["persist"] == {n: n.startswith("head.") for n in trainable}
    for name in trainable:
        assert sum(r["partition_numel"][name] for r in ranks) == first["ds_numel"][name], name
    assert first["partition_numel"] != ranks[1]["partition_numel"], "the flats' slices split parameters unevenly"
    assert first["summary_keys"] == DEEPSPEED_SUMMARY_KEYS
    assert first["summary_debug_id"] == f"name=blocks.0.weight id={first['ids']['blocks.0.weight']}"
    assert not first["has_ds_tensor"]
    full = {n: tuple(p.shape) for n, p in Model().named_parameters()}
    assert first["deepspeed_style_shapes"] == full
    assert not first["stage1_has_ds_id"]
