"""`zeroshard explain` on an MoE model: the expert and dense groups, and the memory estimate
counting expert parameters over the expert-data-parallel size (zeroshard/moe/report.py)."""

from __future__ import annotations

import json
import math
import sys

from zeroshard.tools.explain import explain_data, explain_text

FACTORY = """
from torch import nn
from zeroshard.moe.layer import MoE

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        expert = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.moe = MoE(32, expert, num_experts=8, ep_size=2, k=2)

def make():
    return Net()
"""
EXPERT_NUMEL = 32 * 64 + 64 + 64 * 32 + 32  # one expert
LOCAL_EXPERTS = 8 // 2
DENSE_NUMEL = 16 * 32 + 32 + 8 * 32  # embed + gate (the experts' template `expert` is not kept)


def test_explain_shows_expert_groups_and_estimates_experts_over_edp(tmp_path, monkeypatch) -> None:
    (tmp_path / "moe_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }))
    data = explain_data(str(config), 4, "moe_models:make")
    moe = data["moe"]
    assert moe["dense_sharded_over"] == [0, 1, 2, 3]
    [group] = moe["expert_groups"]
    assert group["expert_parallel_groups"] == [[0, 1], [2, 3]]
    assert group["expert_data_parallel_groups"] == [[0, 2], [1, 3]]
    assert moe["expert_params_per_rank"] == LOCAL_EXPERTS * EXPERT_NUMEL

    # Stage 3, fp32, AdamW: params, grads and 2 states, each a shard; the masters are the params.
    expert_shard = math.ceil(LOCAL_EXPERTS * EXPERT_NUMEL / 2)  # over EDP (2 ranks)
    dense_shard = math.ceil(DENSE_NUMEL / 4)  # over the world
    states = data["memory"]["estimate"]["model_states"]
    assert states["params"] == (expert_shard + dense_shard) * 4
    assert states["optimizer_state"] == 2 * (expert_shard + dense_shard) * 4
    assert data["memory"]["estimate"]["num_params"] == DENSE_NUMEL + LOCAL_EXPERTS * EXPERT_NUMEL

    text = " ".join(explain_text(str(config), 4, "moe_models:make").split())  # rich wraps lines
    assert "tokens exchanged within [[0, 1], [2, 3]], expert parameters sharded over [[0, 2], [1, 3]]" in text
    sys.modules.pop("moe_models", None)
