"""Rank-side scenarios for tests/dist/sharding/test_layout.py: expert parallelism combined with
sequence parallelism on one `ParallelLayout` (world 4: sequence-parallel 2, ep_size 2).

The model: a dense embedding, one Ulysses attention layer (DistributedAttention over the
sequence group), one top-1 MoE layer of 4 experts (2 per expert-parallel rank) and a dense
head. Its weights are a function of each parameter's global name (experts by their global
index), so the reference can hold the same model whole.

Reference (every rank computes it, single process, fp32, written with torch.nn.functional
only, not zeroshard's MoE or attention): sample group g's whole sequences through the model,
its loss the mean squared error over the group's elements, the step's loss the mean over
the 2 groups; torch.optim.SGD with momentum and clip_grad_norm_. The engine run: rank r
holds slice r % 2 of sample group r // 2's sequences, its loss the squared error of its
slice over the group's element count (the slices' losses sum to the group's mean).
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zeroshard
from zeroshard import groups
from zeroshard.moe.layer import MoE
from zeroshard.moe.utils import global_expert_names
from zeroshard.sequence import parallel_state_sp
from zeroshard.sequence.layer import DistributedAttention
from zeroshard.sharding.layout import current_layout

SP, EP = 2, 2
IN, HIDDEN, HEADS, FFN, OUT, EXPERTS = 5, 8, 2, 12, 3, 4
BATCH, SEQ = 2, 8  # per sample group: 2 samples of 8 positions, 4 per sequence rank
STEPS, LR, MOMENTUM, CLIP = 3, 0.1, 0.9, 1.0
LOCAL_TOKENS = BATCH * SEQ // SP
ELEMENTS = BATCH * SEQ * OUT  # one sample group's loss denominator


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention over [batch, seq, heads, head dim] (the whole sequence, this rank's heads)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class Net(nn.Module):
    def __init__(self, sequence_group: Any) -> None:
        super().__init__()
        self.embed = nn.Linear(IN, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.attention = DistributedAttention(_causal, sequence_group, scatter_idx=2, gather_idx=1)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        # Capacity covers every local token (min_capacity), so no token is dropped; no random
        # token selection: the routing is the argmax alone, as in the reference.
        self.moe = MoE(HIDDEN, expert, num_experts=EXPERTS, ep_size=EP, k=1, min_capacity=LOCAL_TOKENS, use_rts=False)
        self.head = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
        h = h + self.proj(self.attention(q, k, v, batch_dim_idx=0).reshape(b, s, HIDDEN))
        moe_out, _, _ = self.moe(self.norm(h))  # the auxiliary loss is left out: it is not additive over slices
        h = h + moe_out
        return ((self.head(h) - y) ** 2).sum() / ELEMENTS


def _initial(name: str, shape: torch.Size) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * (0.4 if len(shape) > 1 else 0.1)


def _global_names(model: nn.Module) -> dict[str, nn.Parameter]:
    experts = global_expert_names(model)
    return {experts.get(id(p), name): p for name, p in model.named_parameters()}


def build_model(sequence_group: Any) -> Net:
    model = Net(sequence_group)
    with torch.no_grad():
        for name, p in _global_names(model).items():
            p.copy_(_initial(name, p.shape))
    return model


def group_batch(step: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + group)
    return torch.randn(BATCH, SEQ, IN, generator=g), torch.randn(BATCH, SEQ, OUT, generator=g)


# ---------------------------------------------------------------- the reference

EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.{}"


def _reference_params() -> dict[str, torch.Tensor]:
    """Every global parameter name -> its initial value (the whole model, all 4 experts)."""
    shapes = {name: p.shape for name, p in Net(None).named_parameters() if "deepspeed_experts" not in name}
    expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
    for e in range(EXPERTS):
        shapes.update({EXPERT.format(e, n): p.shape for n, p in expert.named_parameters()})
    return {name: _initial(name, shape).requires_grad_() for name, shape in shapes.items()}


def _reference_loss(w: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = F.linear(x, w["embed.weight"], w["embed.bias"])
    b, s, _ = h.shape
    q, k, v = F.linear(h, w["qkv.weight"], w["qkv.bias"]).view(b, s, 3, HEADS, HIDDEN // HEADS).unbind(2)
    h = h + F.linear(_causal(q, k, v).reshape(b, s, HIDDEN), w["proj.weight"], w["proj.bias"])
    tokens = F.layer_norm(h, (HIDDEN,), w["norm.weight"], w["norm.bias"]).reshape(-1, HIDDEN)
    gates = F.softmax(F.linear(tokens, w["moe.deepspeed_moe.gate.wg.weight"]), dim=1)
    chosen = gates.argmax(dim=1)
    outs = []
    for t in range(tokens.shape[0]):  # top-1: the chosen expert's output times its gate probability
        e = int(chosen[t])
        hidden = F.gelu(F.linear(tokens[t], w[EXPERT.format(e, "0.weight")], w[EXPERT.format(e, "0.bias")]))
        outs.append(gates[t, e] * F.linear(hidden, w[EXPERT.format(e, "2.weight")], w[EXPERT.format(e, "2.bias")]))
    h = h + torch.stack(outs).view(b, s, HIDDEN)
    return ((F.linear(h, w["head.weight"], w["head.bias"]) - y) ** 2).sum() / ELEMENTS


def reference() -> dict[str, Any]:
    w = _reference_params()
    optimizer = torch.optim.SGD(list(w.values()), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        per_group = [_reference_loss(w, *group_batch(step, g)) for g in range(dist.get_world_size() // SP)]
        torch.stack(per_group).mean().backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append([loss.item() for loss in per_group])
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in w.items()}}


# ---------------------------------------------------------------- the engine


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
    }


def _ranks(handle: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(handle))


def _groups_seen(engine, model: Net, layout_before) -> dict[str, Any]:
    """Every group as the layout, DeepSpeed's getters, the mpu, the engine and the layers see it."""
    name = model.moe.expert_group_name
    return {
        "one_layout": engine.layout is layout_before is current_layout(),
        "dense_shard": engine.layout.dense.shard.ranks,
        "dense_data": groups._get_data_parallel_group().ranks,
        "data": (engine.layout.data.ranks, _ranks(engine.data_parallel_group),
                 _ranks(parallel_state_sp.get_data_parallel_group())),
        "ep": (groups._get_expert_parallel_group_ranks(name), model.moe.deepspeed_moe.ep_group.ranks),
        "edp": groups._get_expert_data_parallel_group_ranks(name),
        "sp": (engine.layout.sequence.ranks, _ranks(engine.seq_parallel_group),
               _ranks(groups._get_sequence_parallel_group()), _ranks(parallel_state_sp.get_sequence_parallel_group())),
        "sp_data": (_ranks(groups._get_sequence_data_parallel_group()),
                    _ranks(parallel_state_sp.get_sequence_data_parallel_group())),
        "expert_flats": sorted({f.spec.shard.ranks for f in engine.flats
                                if any(getattr(p, "allreduce", True) is False for p in f.params)}),
        "dense_flats": sorted({f.spec.shard.ranks for f in engine.flats
                               if all(getattr(p, "allreduce", True) for p in f.params)}),
    }


def train(stages: list[int]) -> list[dict[str, Any]]:
    """For each ZeRO stage: the groups, this rank's losses and the full parameters by global
    name after STEPS, with the reference's."""
    rank = dist.get_rank()
    ref = reference()
    parallel_state_sp.initialize_sequence_parallel(SP)
    results = []
    try:
        layout_before = current_layout()  # made by parallel_state_sp, before initialize
        sequence_group = parallel_state_sp.get_sequence_parallel_group()
        sp_rank = parallel_state_sp.get_sequence_parallel_rank()
        sample_group = parallel_state_sp.get_data_parallel_rank()
        mine = slice(sp_rank * (SEQ // SP), (sp_rank + 1) * (SEQ // SP))
        for stage in stages:
            model = build_model(sequence_group)
            engine, *_ = zeroshard.initialize(model=model, config=_config(stage), mpu=parallel_state_sp)
            losses = []
            for step in range(STEPS):
                x, y = group_batch(step, sample_group)
                loss = engine(x[:, mine], y[:, mine])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            params = {n: zeroshard.safe_get_full_fp32_param(p) for n, p in _global_names(engine.module).items()}
            results.append({
                "stage": stage, "groups": _groups_seen(engine, model, layout_before), "losses": losses,
                "params": params, "ref_losses": ref["losses"], "ref_params": ref["params"], "rank": rank,
            })
    finally:
        parallel_state_sp.destroy_sequence_parallel()
    return results
