"""Rank-side scenario for tests/dist/moe/test_autoep_torch_group.py: an AutoEP layer's
`ep_group` is a torch ProcessGroup that torch.distributed accepts (DeepSpeed's layer keeps one),
while the layer's own collectives keep their zeroshard Group: the engine's forward still equals
the unswapped Hugging Face model's, also after `ep_group` is assigned a torch group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.dist.scenarios.autoep import batch, build_hf
from zeroshard.comm.collectives import Group
from zeroshard.module_inject.auto_ep import autoep_layers


def torch_group_case(kind: str) -> dict[str, Any]:
    rank = dist.get_rank()
    reference = build_hf(kind).eval()  # the same seeded weights as the model the engine swaps
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    model = build_hf(kind)
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.eval()
    layers = [layer for _, layer in autoep_layers(engine.module)]
    layer = layers[0]
    group = layer.ep_group
    summed = torch.tensor([float(rank + 1)])
    dist.all_reduce(summed, group=group)  # torch's own collective on the layer's group
    x = batch(rank)
    with torch.no_grad():
        expected = reference(x).logits
        before = engine(input_ids=x).logits
        for each in layers:  # DeepSpeed code assigns torch groups; the layer keeps working
            each.ep_group = each.ep_group
        after = engine(input_ids=x).logits
    return {
        "is_process_group": isinstance(group, dist.ProcessGroup),
        "world_size": dist.get_world_size(group=group),
        "group_rank": dist.get_rank(group=group),
        "ranks": dist.get_process_group_ranks(group),
        "all_reduce": summed.item(),
        "expert_group": (type(layer.expert_group) is Group, layer.expert_group.ranks),
        "same_group_everywhere": all(each.ep_group is group for each in layers),
        "diff_before": (before - expected).abs().max().item(),
        "diff_after": (after - expected).abs().max().item(),
        "logit_scale": expected.abs().max().item(),
    }
