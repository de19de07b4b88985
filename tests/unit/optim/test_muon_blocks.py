"""How Muon cuts a parameter into Newton-Schulz matrices (zeroshard/optim/muon/blocks.py,
heads.py): unmarked N-D weights are one (out, rest) matrix, marked 3-D stacks are per expert,
attention projections per head (rows for q/k/v, columns for o).

References are written here in float64 from the formula (tests/dist/ns_reference.py), one
block at a time with plain slicing. The model runs in float64 too, so Muon's Newton-Schulz
runs in float64 ("auto" keeps float64): the only difference is the Gram form's rounding
against the standard iteration, ~1e-13 here; ATOL = 1e-10 leaves a wide margin and is 1e-8
of what separates the right cut from the wrong one (checked in each test).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests.dist.ns_reference import reference_newton_schulz
from tests.unit.optim.muon_models import tiny
from zeroshard.optim.muon.blocks import BlockLayout, block_layout, param_block_layout
from zeroshard.optim.muon.heads import mark_expert_stacks, tag_attention_heads
from zeroshard.optim.muon.optimizer import Muon, muon_param_plan, parse_muon_params

LR, MOMENTUM = 0.1, 0.9
ATOL = 1e-10


def ns_update(u: torch.Tensor) -> torch.Tensor:
    """NS of one 2-D matrix times Muon's shape factor, float64."""
    return reference_newton_schulz(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))


def one_muon_step(model: nn.Module, loss_fn, **kwargs) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(u, parameter change) of every parameter after one Muon step (weight decay 0)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = Muon(model, lr=LR, momentum=MOMENTUM, adam_lr=0.0, **kwargs)
    loss_fn(model).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    # Nesterov from zero momentum: m = (1 - b) g, u = (1 - b) g + b m.
    return {n: ((1 - MOMENTUM) * (1 + MOMENTUM) * grads[n], p.detach() - before[n])
            for n, p in model.named_parameters()}


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv1d(4, 6, kernel_size=3, bias=False)  # [6, 4, 3] -> one 6x12 matrix
        self.conv2 = nn.Conv2d(2, 5, kernel_size=2, bias=False)  # [5, 2, 2, 2] -> one 5x8 matrix
        self.stack = nn.Parameter(torch.randn(3, 4, 6))  # marked below: three 4x6 experts

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        mixed = torch.einsum("bi,eoi->beo", x1[:, :, 0].repeat(1, 2)[:, :6], self.stack)
        return self.conv1(x1).pow(2).mean() + self.conv2(x2).pow(2).mean() + mixed.tanh().sum()


def _conv_loss(model: ConvNet) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return model(torch.randn(3, 4, 7, generator=gen, dtype=torch.float64),
                 torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64))


def test_conv_weights_are_one_out_by_rest_matrix_and_marked_stacks_per_expert():
    model = ConvNet().double()
    model.stack.is_expert_group = True
    plan = {c.name: c.reason for c in muon_param_plan(model)}
    assert plan == {"conv1.weight": "3-D, viewed as 6x12", "conv2.weight": "4-D, viewed as 5x8",
                    "stack": "3 stacked matrices 4x6"}
    moves = one_muon_step(model, _conv_loss)
    for name in ("conv1.weight", "conv2.weight"):
        u, moved = moves[name]
        expected = -LR * ns_update(u.reshape(u.shape[0], -1)).reshape(u.shape)
        torch.testing.assert_close(moved, expected, rtol=0, atol=ATOL)
    u, moved = moves["conv1.weight"]
    per_slice = -LR * torch.stack([ns_update(s) for s in u])  # DeepSpeed 0.19's cut of a 3-D weight
    assert (moved - per_slice).abs().max() > 1e-3
    u, moved = moves["stack"]
    torch.testing.assert_close(moved, -LR * torch.stack([ns_update(e) for e in u]), rtol=0, atol=ATOL)


def test_an_unmarked_3d_weight_is_one_matrix():
    model = ConvNet().double()  # stack left unmarked
    assert {c.name: c.reason for c in muon_param_plan(model)}["stack"] == "3-D, viewed as 3x24"
    u, moved = one_muon_step(model, _conv_loss)["stack"]
    torch.testing.assert_close(moved, -LR * ns_update(u.reshape(3, 24)).reshape(u.shape), rtol=0, atol=ATOL)


def test_block_views_are_the_head_slices():
    t = torch.arange(6 * 8.0).reshape(6, 8)
    rows = block_layout(t.shape, num_heads=3)
    assert rows == BlockLayout(3, 2, 8, 0, "heads")
    assert all(torch.equal(rows.to_blocks(t.reshape(-1))[h], t[2 * h : 2 * h + 2]) for h in range(3))
    cols = block_layout(t.shape, head_dim=2, head_axis=1)
    assert cols == BlockLayout(4, 6, 2, 1, "heads")
    blocks = cols.to_blocks(t.reshape(-1))
    assert all(torch.equal(blocks[h], t[:, 2 * h : 2 * h + 2]) for h in range(4))
    assert torch.equal(cols.from_blocks(blocks), t.reshape(-1))
    assert cols.describe() == "per-head: 4 column blocks 6x2"


@pytest.mark.parametrize("kwargs, match", [
    ({"shape": (4, 6), "is_expert_group": True}, "is_expert_group=True, which marks a stack"),
    ({"shape": (6, 8), "num_heads": 4}, r"muon_num_heads=4 does not divide axis 0 \(6\)"),
    ({"shape": (6, 8), "head_dim": 3, "head_axis": 1}, r"muon_head_dim=3 does not divide axis 1 \(8\)"),
    ({"shape": (6, 8), "num_heads": 3, "head_dim": 3}, "does not divide"),
    ({"shape": (6, 8), "num_heads": 2, "head_axis": 2}, "muon_head_axis=2 must be 0"),
    ({"shape": (2, 6, 8), "num_heads": 2}, "heads split a 2-D weight"),
    ({"shape": (6, 8), "num_heads": 0}, "must be a positive integer"),
])
def test_bad_marks_name_the_parameter_and_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        block_layout(**kwargs, name="w")


def test_config_keys():
    assert parse_muon_params({"per_head_muon": True}).per_head_muon
    assert not parse_muon_params({}).per_head_muon_output
    with pytest.raises(ValueError, match="per_head_muon='yes': must be true or false"):
        parse_muon_params({"per_head_muon": "yes"})
    with pytest.raises(ValueError, match="per_head_muon_output=true needs per_head_muon=true"):
        parse_muon_params({"per_head_muon_output": True})


# ------------------------------------------------------------- Hugging Face presets
# Without per_head_muon_output these are exactly the tags DeepSpeed 0.19.8's
# `deepspeed.set_optimizer_flags` puts on the same tiny models with `per_head_muon: true`
# (muon_num_heads, muon_head_dim), observed in /tmp/dsvenv when this test was written.
STANDARD = {"q_proj": (4, 6, 0), "k_proj": (2, 6, 0), "v_proj": (2, 6, 0)}  # GQA: 2 key/value heads


@pytest.mark.parametrize("family, expected", [
    ("llama", STANDARD), ("qwen3", STANDARD), ("qwen3_moe", STANDARD),
    ("mixtral", {"q_proj": (4, 4, 0), "k_proj": (2, 4, 0), "v_proj": (2, 4, 0)}),
    # MLA: q_b_proj heads of qk_nope + qk_rope = 8, kv_b_proj heads of qk_nope + v_head_dim = 10.
    ("deepseek_v3", {"q_b_proj": (4, 8, 0), "kv_b_proj": (4, 10, 0)}),
])
@pytest.mark.parametrize("output", [False, True])
def test_presets_tag_the_attention_projections(family, expected, output):
    pytest.importorskip("transformers")
    model = tiny(family)
    tagged = tag_attention_heads(model, output)
    expected = dict(expected)
    if output:
        expected["o_proj"] = (4, 6 if family != "mixtral" else 4, 1)  # DeepSeek-V3: v_head_dim 6
    got = {}
    for name, p in model.named_parameters():
        leaf = name.split(".")[-2]
        if getattr(p, "muon_num_heads", None) is not None:
            got[leaf] = (p.muon_num_heads, p.muon_head_dim, p.muon_head_axis)
    assert got == expected and len(tagged) == len(expected)
    plan = {c.name.split(".")[-2]: c for c in muon_param_plan(model) if "self_attn" in c.name}
    if family == "deepseek_v3":  # the down-projections to the shared latents stay whole
        assert plan["q_a_proj"].reason == "matrix 12x16" and plan["kv_a_proj_with_mqa"].reason == "matrix 12x16"
    assert plan["q_b_proj" if family == "deepseek_v3" else "q_proj"].reason.startswith("per-head: 4 row blocks")


def test_hugging_face_expert_stacks_are_marked():
    pytest.importorskip("transformers")
    model = tiny("qwen3_moe")
    assert sorted(mark_expert_stacks(model)) == ["model.layers.0.mlp.experts.down_proj",
                                                 "model.layers.0.mlp.experts.gate_up_proj"]
    plan = {c.name: c.reason for c in muon_param_plan(model)}
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] == "4 stacked matrices 16x16"


def test_per_head_muon_without_a_preset_or_attributes_is_refused():
    with pytest.raises(ValueError, match="no family with a per-head preset"):
        muon_param_plan(ConvNet(), {"per_head_muon": True})


def test_user_attributes_win_and_work_without_the_config_key():
    pytest.importorskip("transformers")
    model = tiny("llama")
    q = model.model.layers[0].self_attn.q_proj.weight
    q.muon_head_dim = 12  # 2 blocks of 12 rows, not the config's 4 of 6
    tag_attention_heads(model)
    assert param_block_layout("q", q) == BlockLayout(2, 12, 16, 0, "heads")


def _lm_loss(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_single_process_per_head_update_against_float64(family):
    pytest.importorskip("transformers")
    model = tiny(family).double()
    moves = one_muon_step(model, _lm_loss, per_head_muon=True, per_head_muon_output=True)
    heads = {"q_proj": 4, "k_proj": 2, "v_proj": 2, "q_b_proj": 4, "kv_b_proj": 4}
    checked = 0
    for name, (u, moved) in moves.items():
        leaf = name.split(".")[-2]
        if leaf in heads:
            blocks = [ns_update(b) for b in u.chunk(heads[leaf], dim=0)]
            expected = -LR * torch.cat(blocks, dim=0)
        elif leaf == "o_proj":
            expected = -LR * torch.cat([ns_update(b) for b in u.chunk(4, dim=1)], dim=1)
        else:
            continue
        torch.testing.assert_close(moved, expected, rtol=0, atol=ATOL)
        assert (moved + LR * ns_update(u)).abs().max() > 1e-3  # whole-matrix Muon differs
        checked += 1
    assert checked == (4 if family == "llama" else 3)


def test_autoep_expert_stacks_are_orthogonalized_per_expert():
    """AutoEP's swapped stacks (w1/w3 [experts, ffn, hidden], w2 [experts, hidden, ffn]) carry
    is_expert_group, so each expert is one Newton-Schulz matrix (world 1, one process)."""
    pytest.importorskip("transformers")
    from zeroshard.config.expert_parallel import ExpertParallelConfig
    from zeroshard.module_inject.auto_ep import replace_moe_layers

    model = tiny("qwen3_moe")
    replace_moe_layers(model, ExpertParallelConfig(enabled=True), world_size=1)
    moves = one_muon_step(model.double(), _lm_loss)
    for stack in ("w1", "w2", "w3"):
        u, moved = moves[f"model.layers.0.mlp.experts.{stack}"]
        assert u.shape[0] == 4
        torch.testing.assert_close(moved, -LR * torch.stack([ns_update(e) for e in u]), rtol=0, atol=ATOL)
        whole = -LR * ns_update(u.reshape(u.shape[0], -1)).reshape(u.shape)
        assert (moved - whole).abs().max() > 1e-3, stack
