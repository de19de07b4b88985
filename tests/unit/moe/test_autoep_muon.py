"""Which optimizer Muon gives an AutoEP model's parameters: the stacked expert weights
[local experts, rows, cols] are Muon matrices orthogonalised per expert slice (AutoEP marks them
`is_expert_group`),
the score-correction bias is a buffer (no optimizer), norms are AdamW (1-D), and the router
goes to AdamW through `muon_exclude_patterns` (the classifier has no per-parameter marker)."""

import pytest

from zeroshard.config.expert_parallel import ExpertParallelConfig
from zeroshard.module_inject.auto_ep import replace_moe_layers
from zeroshard.optim.muon.optimizer import matrix_layout, muon_param_plan

pytest.importorskip("transformers")


def test_expert_stacks_are_muon_per_slice_and_the_router_adamw() -> None:
    from tests.unit.moe.autoep_models import tiny_deepseek_v3

    model = tiny_deepseek_v3()
    replace_moe_layers(model, ExpertParallelConfig(enabled=True), world_size=1)
    plan = {c.name: c for c in muon_param_plan(model, {"muon_exclude_patterns": ["embed", "lm_head", "router"]})}
    w1 = plan["model.layers.1.mlp.experts.w1"]
    assert w1.use_muon and w1.reason == "8 stacked matrices 8x16"
    assert w1.layout is not None and (w1.layout.count, w1.layout.rows, w1.layout.cols) == (8, 8, 16)
    assert matrix_layout(w1.shape, is_expert_group=True) == (8, 8, 16)
    stacks = [p for n, p in model.named_parameters() if n.endswith(("experts.w1", "experts.w2", "experts.w3"))]
    assert stacks and all(p.is_expert_group is True for p in stacks)  # AutoEP marks its stacks
    assert plan["model.layers.1.mlp.experts.w2"].use_muon
    assert not plan["model.layers.1.mlp.router.gate.weight"].use_muon
    assert not plan["model.layers.1.post_attention_layernorm.weight"].use_muon
    assert "model.layers.1.mlp.router.e_score_correction_bias" not in plan  # a buffer, moved by load balancing
    assert plan["model.layers.1.mlp.shared_experts.up_proj.weight"].use_muon
