"""Rank-side scenarios for tests/dist/optim/test_muon_parity.py: Muon on a model with expert
parameters and grouped-query attention (for QK-clip), under every engine dimension.

The model holds both expert layouts: DeepSpeed's MoE layer (one 2-D Linear per expert, a
`gate.wg` router) and AutoEP's stacked layout (`experts.w1` [local experts, ffn, hidden],
`experts.w2` [local experts, hidden, ffn], marked as expert parameters of the same expert
group, and a dense `router`). The stacked block needs no token exchange: each rank's tokens
go to its own expert block, softly weighted by the router's columns for those experts, so one
process reproduces rank r's forward by using expert block r % ep_size of the full stack
(`StackedExperts.first`). Weights are a function of each parameter's global name (and, for the
stack, of the global expert index), so every ep_size starts from the same model.

The attention block (`Attention`: 4 query heads over 2 key heads, biased query and key
projections) is a custom module registered with `register_qk_clip_heads`; it reports its
logits with `record_logits`, and in the one-process reference appends each head's maximum
of its own full logit matrix to `probe` (tests/dist/muon_reference.py's formula).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from tests.dist import muon_reference as ref
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import global_expert_names, split_params_into_different_moe_groups_for_optimizer
from zeroshard.optim.muon.qk_clip import record_logits, register_qk_clip_heads
from zeroshard.optim.muon.sharded import ShardedMuon
from zeroshard.utils.groups import expert_group_name

HIDDEN, IN, OUT, TOKENS, NUM_EXPERTS, FFN = 8, 5, 4, 6, 4, 12
STEPS, CLIP = 2, 0.5
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4
TAU, ALPHA = 1.2, 0.5  # first-step logits ~0.5-1.7: heads on both sides
MUON_LR, ADAM_LR, MOMENTUM, WD, BETAS, EPS = 0.05, 0.01, 0.9, 0.1, (0.9, 0.95), 1e-8
STACKED = ("stacked.experts.w1", "stacked.experts.w2")


class StackedExperts(nn.Module):
    """`count` experts stacked as AutoEP stores them; they serve global experts
    [first, first + count) of the router's columns, from stack row `offset`."""

    def __init__(self, stack_size: int, first: int, ep_size: int) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = nn.Module()
        self.experts.w1 = nn.Parameter(torch.empty(stack_size, FFN, HIDDEN))  # tall slices
        self.experts.w2 = nn.Parameter(torch.empty(stack_size, HIDDEN, FFN))  # wide slices
        for p in (self.experts.w1, self.experts.w2):
            p.allreduce = False
            p.group_name = expert_group_name(ep_size)
            p.is_expert_group = True  # as AutoEP marks its stacks
        self.count = NUM_EXPERTS // ep_size
        self.first = first
        self.offset = 0  # the full stack (the one-process reference) reads from row `first`

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        rows = slice(self.offset, self.offset + self.count)
        weights = F.softmax(self.router(h), dim=-1)[:, self.first : self.first + self.count]
        inner = F.gelu(torch.einsum("td,efd->tef", h, self.experts.w1[rows]))
        out = torch.einsum("tef,edf->ted", inner, self.experts.w2[rows])
        return h + torch.einsum("te,ted->td", weights, out)


class Attention(nn.Module):
    """Causal grouped-query self-attention over the tokens (a biased query: QK-clip scales the bias too)."""

    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        # No key bias: it shifts a query's logits equally (softmax ignores it), so its gradient
        # is rounding noise that AdamW's normalisation would blow up to lr-sized steps.
        self.wk = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        register_qk_clip_heads(self, ("wq.weight", "wq.bias"), "wk.weight", HEADS, HEAD_DIM, KV_HEADS)
        self.probe: list[torch.Tensor] | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        tokens = h.shape[0]
        q = self.wq(h).view(1, tokens, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.wk(h).view(1, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.wv(h).view(1, tokens, KV_HEADS, HEAD_DIM).transpose(1, 2)
        scaling = HEAD_DIM**-0.5
        record_logits(self, q, k, scaling, is_causal=True)
        if self.probe is not None:
            self.probe.append(ref.eager_logit_max(q.detach(), k.detach(), scaling, None))
        group = HEADS // KV_HEADS
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             is_causal=True, scale=scaling)
        return h + self.wo(out.transpose(1, 2).reshape(tokens, HEADS * HEAD_DIM))


class MoEMuonNet(nn.Module):
    def __init__(self, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)  # AdamW by name
        self.attn = Attention()
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=NUM_EXPERTS, ep_size=ep_size, k=2, min_capacity=2,
                       top2_2nd_expert_sampling=False)
        local = NUM_EXPERTS // ep_size
        self.stacked = StackedExperts(local, ep_rank * local, ep_size)
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, OUT)  # a 4x8 matrix: Muon

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.attn(self.embed(x))
        out, l_aux, _ = self.moe(h)
        h = self.stacked(h + out)
        return F.mse_loss(self.head(self.norm(h)), y) + 0.01 * l_aux


def mark_heads(model: nn.Module) -> None:
    """Per-head Muon through the parameter attributes (optim/muon/blocks.py): query, key and
    value rows per head, the output projection's columns per head."""
    attn = model.attn
    attn.wq.weight.muon_num_heads = HEADS
    attn.wk.weight.muon_num_heads = KV_HEADS
    attn.wv.weight.muon_num_heads = KV_HEADS
    attn.wo.weight.muon_num_heads = HEADS
    attn.wo.weight.muon_head_axis = 1


def global_names(model: nn.Module) -> dict[str, nn.Parameter]:
    experts = global_expert_names(model)
    return {experts.get(id(p), name): p for name, p in model.named_parameters()}


def build_model(ep_size: int, ep_rank: int, full_stack: bool = False) -> MoEMuonNet:
    """`full_stack`: the one-process reference (ep_size 1 layout, every expert in the stack)."""
    model = MoEMuonNet(1 if full_stack else ep_size, ep_rank)
    if full_stack:
        model.stacked.count = NUM_EXPERTS // ep_size
    with torch.no_grad():
        for name, p in global_names(model).items():
            if name in STACKED:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                full = torch.randn((NUM_EXPERTS, *p.shape[1:]), generator=g) * 0.4
                # Experts of very different scale: Newton-Schulz must normalise each on its own.
                full *= torch.tensor([1.0, 0.01, 3.0, 0.3]).view(-1, 1, 1)
                p.copy_(full if full_stack else full[model.stacked.first : model.stacked.first + p.shape[0]])
                continue
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            scale = 0.4 if p.dim() > 1 else 0.1
            if name.startswith(("attn.wq", "attn.wk")):
                scale *= 2.0  # logits over TAU in some heads
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def micro_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(20_000 + 100 * step + 10 * micro + rank)
    return torch.randn(TOKENS, IN, generator=g), torch.randn(TOKENS, OUT, generator=g)


@dataclass(frozen=True)
class MuonCase:
    ep_size: int
    stage: int
    user_groups: bool = False  # model_parameters from split_params_into_different_moe_groups_for_optimizer
    ga: int = 2
    offload: bool = False
    qk_clip: bool = False
    per_head: bool = False  # attention projections orthogonalized one head block at a time
    clip: float = CLIP

    @property
    def label(self) -> str:
        return (f"ep{self.ep_size}-stage{self.stage}-ga{self.ga}" + ("-offload" if self.offload else "")
                + ("-qkclip" if self.qk_clip else "") + ("-per-head" if self.per_head else "")
                + ("-user-groups" if self.user_groups else "")
                + ("" if self.clip == CLIP else f"-clip{self.clip}"))


def muon_config(case: MuonCase) -> dict[str, Any]:
    params: dict[str, Any] = {
        "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD,
        "betas": list(BETAS), "eps": EPS, "ns_method": "gram",
    }
    if case.qk_clip:
        params["qk_clip"] = {"enabled": True, "threshold": TAU, "alpha": ALPHA}
    zero: dict[str, Any] = {"stage": case.stage, "stage3_param_persistence_threshold": 0}
    if case.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": case.ga,
        "gradient_clipping": case.clip,
        "optimizer": {"type": "Muon", "params": params},
        "zero_optimization": zero,
        "steps_per_print": 1000,
    }


class _CountNewtonSchulz:
    """Counts the matrices ShardedMuon orthogonalizes (each call's batch) while active."""

    def __init__(self) -> None:
        self.matrices = 0
        self.original = ShardedMuon.orthogonalize  # the class's (eager) Newton-Schulz

    def __call__(self, batch, *args, **kwargs):
        self.matrices += batch.shape[0]
        return self.original(batch, *args, **kwargs)

    def __enter__(self):
        ShardedMuon.orthogonalize = staticmethod(self)
        return self

    def __exit__(self, *exc) -> None:
        del ShardedMuon.orthogonalize  # back to the one it inherits


def train_cases(cases: list[MuonCase]) -> list[dict[str, Any]]:
    """Per case: each parameter's optimizer group (use_muon, lr, moe), the stack's first
    global expert, every parameter's full fp32 master after each step by global name, the
    matrices this rank orthogonalized in each step, and QK-clip's reduced S_max per step."""
    rank = dist.get_rank()
    results = []
    for case in cases:
        model = build_model(case.ep_size, rank % case.ep_size)
        if case.per_head:
            mark_heads(model)
        params = None
        if case.user_groups:
            params = split_params_into_different_moe_groups_for_optimizer(
                {"params": list(model.parameters()), "name": "all"}
            )
        engine, optimizer, _, _ = zeroshard.initialize(model=model, model_parameters=params,
                                                      config=muon_config(case))
        groups = {}
        for name, p in global_names(engine.module).items():
            group = optimizer.param_groups[engine.locate(p)[0].optimizer_group]
            groups[name] = (bool(group["use_muon"]), float(group["lr"]), bool(group.get("moe", False)))
        masters, ns_matrices, s_max = [], [], []
        for step in range(STEPS):
            with _CountNewtonSchulz() as count:
                for micro in range(case.ga):
                    engine.backward(engine(*micro_batch(rank, step, micro)))
                    engine.step()
            ns_matrices.append(count.matrices)
            if engine.qk_clip is not None:
                s_max.append(engine.qk_clip.last_max.clone())
            masters.append({n: zeroshard.safe_get_full_fp32_param(p) for n, p in global_names(engine.module).items()})
        edp = [f.spec.shard.size for f in engine.flats if "stacked.experts.w1" in f.names]
        results.append({"groups": groups, "first": engine.module.stacked.first, "masters": masters,
                        "optimizer": type(optimizer).__name__, "owners": optimizer.owner_of(), "edp": edp[0],
                        "ns_matrices": ns_matrices, "s_max": s_max})
    return results
