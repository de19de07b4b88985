"""Per-head Muon (issue 26 item 2) at ZeRO stages 0-3, world 2, on tiny Hugging Face models:
Llama with grouped-query attention (4 query heads, 2 key/value heads) at stages 0-3 and
DeepSeek-V3 with MLA at stages 0 and 3.

The engine is configured by `per_head_muon` and `per_head_muon_output` only; the presets tag
the projections (stage 3 builds the model under zero.Init, so they read full shapes from
ds_shape). The reference is one process in float64, written here from the formulas: the
unwrapped model on both ranks' batches, gradients averaged and clipped to the global norm
1.0 (DeepSpeed's default; it acts: Newton-Schulz's 1e-7 in its normaliser is not negligible
against these q/k gradients of norm ~1e-4, so the reference must clip exactly), then Muon on the Muon matrices
(Nesterov momentum, Newton-Schulz of each head block on its own, times sqrt(max(1, rows /
cols)) of the block, decoupled weight decay) and torch's AdamW on the rest, with blocks cut
by plain slicing: q/k/v rows (k/v with num_key_value_heads), o columns, MLA's q_b_proj and
kv_b_proj rows; q_a_proj and kv_a_proj_with_mqa whole.

Tolerance: 5e-6 absolute on parameters after 2 steps (largest seen: 1.1e-6). The engine sums fp32 gradients (~1e-7
relative) and runs Newton-Schulz in fp32 (~5e-6 on O's entries, test_newton_schulz.py), times
lr = 0.05. Orthogonalizing a projection whole instead of per head moves it by >1e-3 (checked).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist.ns_reference import reference_newton_schulz
from tests.dist.scenarios.muon_heads import ADAM_LR, CLIP, MOMENTUM, MUON_LR, STEPS, WD, batch, train_cases
from tests.unit.optim.muon_models import tiny

pytest.importorskip("transformers")

WORLD = 2
PARAM_ATOL = 5e-6
BETAS, EPS = (0.9, 0.95), 1e-10  # the Muon config's AdamW defaults (DeepSpeed's)
FAMILIES = ("llama", "deepseek_v3")
# GQA on every stage; MLA on the replicated and the fully sharded one (suite time).
CASES = [("llama", stage, True) for stage in (0, 1, 2, 3)] + [("deepseek_v3", stage, True) for stage in (0, 3)]
# (blocks, dim) per projection: rows (dim 0) or columns (dim 1).
HEADS = {
    "llama": {"q_proj": (4, 0), "k_proj": (2, 0), "v_proj": (2, 0), "o_proj": (4, 1)},
    "deepseek_v3": {"q_b_proj": (4, 0), "kv_b_proj": (4, 0), "o_proj": (4, 1)},
}


def ns(u: torch.Tensor) -> torch.Tensor:
    return reference_newton_schulz(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))


def orthogonalized(name: str, u: torch.Tensor, family: str, per_head: bool = True) -> torch.Tensor:
    leaf = name.split(".")[-2]
    if per_head and leaf in HEADS[family]:
        blocks, dim = HEADS[family][leaf]
        return torch.cat([ns(b) for b in u.chunk(blocks, dim=dim)], dim=dim)
    return ns(u)


def is_muon(name: str, p: torch.Tensor) -> bool:
    parts = set(name.split("."))
    return p.dim() >= 2 and "embed" not in name and "lm_head" not in name and not parts & {"gate", "router"}


def reference_run(family: str, per_head: bool = True) -> list[dict[str, torch.Tensor]]:
    model = tiny(family).double()
    params = dict(model.named_parameters())
    state: dict[str, dict[str, torch.Tensor]] = {n: {} for n in params}
    history = []
    for step in range(1, STEPS + 1):
        model.zero_grad()
        for rank in range(WORLD):
            x = batch(rank, step - 1)
            (model(input_ids=x, labels=x).loss / WORLD).backward()
        norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in params.values()))
        coef = min(1.0, CLIP / (norm.item() + 1e-6))
        with torch.no_grad():
            for n, p in params.items():
                g, s = p.grad * coef, state[n]
                if is_muon(n, p):
                    s["m"] = MOMENTUM * s.get("m", torch.zeros_like(p)) + (1 - MOMENTUM) * g
                    u = (1 - MOMENTUM) * g + MOMENTUM * s["m"]
                    p.copy_(p * (1 - MUON_LR * WD) - MUON_LR * orthogonalized(n, u, family, per_head))
                else:
                    s["m1"] = BETAS[0] * s.get("m1", torch.zeros_like(p)) + (1 - BETAS[0]) * g
                    s["v"] = BETAS[1] * s.get("v", torch.zeros_like(p)) + (1 - BETAS[1]) * g * g
                    m_hat, v_hat = s["m1"] / (1 - BETAS[0] ** step), s["v"] / (1 - BETAS[1] ** step)
                    p.copy_(p * (1 - ADAM_LR * WD) - ADAM_LR * m_hat / (v_hat.sqrt() + EPS))
        history.append({n: p.detach().clone() for n, p in params.items()})
    return history


def test_per_head_muon_matches_the_float64_reference_on_every_stage(dist_pool):
    per_rank = dist_pool(WORLD).run(train_cases, CASES, timeout=300)
    references = {family: reference_run(family) for family in FAMILIES}
    for index, (family, stage, _) in enumerate(CASES):
        result = per_rank[0][index]
        for step, (ours, ref) in enumerate(zip(result["masters"], references[family], strict=True), start=1):
            assert ours.keys() == ref.keys()
            for name, value in ours.items():
                where = f"{family} stage {stage} step {step} {name}"
                torch.testing.assert_close(value.double(), ref[name], rtol=0, atol=PARAM_ATOL,
                                           msg=lambda m, where=where: f"{where}: {m}")
        # Each head block is one Newton-Schulz matrix with an owner; every rank agrees.
        owners = result["owners"]
        assert all(r[index]["owners"] == owners for r in per_rank)
        for leaf, (blocks, _) in HEADS[family].items():
            name = f"model.layers.0.self_attn.{leaf}.weight"
            assert [k for k in owners if k.startswith(name)] == [f"{name}[{h}]" for h in range(blocks)], leaf
        if family == "deepseek_v3":
            assert "model.layers.0.self_attn.q_a_proj.weight" in owners  # whole: one matrix
        if stage > 0:  # the stages differ only in where elements live
            stage0 = per_rank[0][CASES.index((family, 0, True))]["masters"]
            for ours, first in zip(result["masters"], stage0, strict=True):
                for name in ours:
                    assert torch.equal(ours[name], first[name]), f"{family} stage {stage} vs 0: {name}"
    # Per head is not whole: the reference without heads is far from what the engine did.
    for family in FAMILIES:
        whole = reference_run(family, per_head=False)[0]
        ours = per_rank[0][CASES.index((family, 0, True))]["masters"][0]
        for leaf in HEADS[family]:
            name = f"model.layers.0.self_attn.{leaf}.weight"
            assert (ours[name].double() - whole[name]).abs().max() > 1e-3, f"{family} {leaf}"
