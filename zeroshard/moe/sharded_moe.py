"""The router of an MoE layer: DeepSpeed's gating functions and its `TopKGate`, at DeepSpeed's
import path (`deepspeed.moe.sharded_moe`), with its signatures, semantics and return forms.

A router only scores tokens, picks experts and decides which routes fit an expert's capacity;
it moves no tokens (zeroshard/moe/dispatcher.py does). Every gating function computes in fp32:

* **scores**: softmax over the experts of the logits ([tokens S, experts E]).
* **selection**: top-1 (argmax, or of Gumbel-noised logits under "RSample"), top-2 (the second
  expert by argmax of the logits, Gumbel-noised when `top2_2nd_expert_sampling`, with the first
  masked out) or top-k (the k highest probabilities).
* **capacity**: `ceil(S / E * capacity_factor * k)`, at least `min_capacity`, computed in fp32
  as DeepSpeed does. Without drops (`drop_tokens=False`) it is the largest expert load. Either
  way it is agreed by exactly one MAX all-reduce on `ep_group` (none when the group is None or
  one rank): ranks may hold different token counts S (a smaller last batch, dynamic padding),
  and the all-to-all exchanges E x C slots with every rank of the group, so every rank must use
  the same C. With drops that is the capacity of the rank holding the most tokens (DeepSpeed
  agrees only the dropless one, and its ranks then abort in the exchange).
* **drops**: top-1 keeps per expert a random subset (`use_rts`: random token selection, the
  torch RNG) or the first arrivals; top-2 the first arrivals, every first choice before any
  second choice; top-k by `drop_policy`: "probs" keeps per expert the tokens with the highest
  top-k-masked probability (the softmax value, not the raw logit), "position" the first
  arrivals. A dropped route gets no slot and its token no output from that expert.
* **gates**: top-1 weights a kept route by its probability; top-2 and top-k renormalise the
  kept routes' probabilities to sum to one per token (a token with every route dropped keeps
  zeros).
* **auxiliary loss** (load balancing): with `me` the mean probability per expert and `ce` the
  fraction of tokens whose first choice (top-1, top-2) or any choice (top-k) is that expert:
  top-1 `E * sum(me * ce)`, top-2 `E * E * mean(me * ce)`, top-k `E * E / k * mean(me * ce)`.

Return forms: dense `(l_aux, combine_weights [S, E, C] fp32, dispatch_mask [S, E, C] bool,
exp_counts [E])`, or with `sparse_routes=True` `(l_aux, capacity, num_experts, indices [k, S]
int32, locations [k, S] int32, gates [k, S] fp32, exp_counts)` where a dropped route has
index -1. `exp_counts` counts every route chosen before drops.

Randomness ("Jitter", "RSample", random token selection, second-expert sampling) is drawn from
torch's default generator, so a seeded run repeats.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zeroshard.comm import collectives as comm
from zeroshard.comm.collectives import Group

__all__ = [
    "top1gating",
    "top2gating",
    "topkgating",
    "TopKGate",
    "multiplicative_jitter",
    "gumbel_rsample",
]

DROP_POLICIES = ("probs", "position")
NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def multiplicative_jitter(x: Tensor, device: torch.device | None = None, epsilon: float = 1e-2) -> Tensor:
    """`x` times uniform noise in [1 - epsilon, 1 + epsilon) (the "Jitter" policy)."""
    if epsilon == 0:
        return x
    noise = torch.rand(x.shape, device=x.device, dtype=x.dtype)
    return x * (1.0 - epsilon + 2.0 * epsilon * noise)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device | None = None) -> Tensor:
    """Standard Gumbel noise: -log(E) with E ~ Exp(1)."""
    return -torch.empty(shape, device=device).exponential_().log()


def _as_group(ep_group: object) -> Group | None:
    if ep_group is None or isinstance(ep_group, Group):
        return ep_group
    return comm.group_of(ep_group)  # a torch process group, as DeepSpeed code passes


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> Tensor:
    """DeepSpeed's capacity in its arithmetic: the factor is an fp32 tensor, so the product is
    fp32 before the ceiling (an fp64 product can round to the other side of an integer)."""
    factor = torch.tensor(capacity_factor, dtype=torch.float32)
    capacity = torch.ceil((num_tokens / num_experts) * factor).to(torch.int64)
    return torch.clamp(capacity, min=int(min_capacity))


def _agreed_capacity(capacity: Tensor, device: torch.device, ep_group: Group | None) -> Tensor:
    """The largest of the expert-parallel group's capacities (this rank's with no group)."""
    if ep_group is None or ep_group.size == 1:
        return capacity
    capacity = capacity.to(device=device, dtype=torch.int64, copy=True)
    comm.all_reduce(capacity, group=ep_group, op=torch.distributed.ReduceOp.MAX, tag="moe_capacity")
    return capacity


def _dropless_capacity(exp_counts: Tensor, ep_group: Group | None) -> Tensor:
    """The largest expert load on any rank of the expert-parallel group."""
    return _agreed_capacity(exp_counts.max(), exp_counts.device, ep_group)


def _first_arrivals(mask: Tensor, capacity: Tensor) -> Tensor:
    """`mask` [S, E] keeping per expert its first `capacity` routes in token order."""
    return mask * torch.lt(torch.cumsum(mask, dim=0) - 1, capacity)


def _top_per_expert(mask: Tensor, scores: Tensor, capacity: Tensor) -> Tensor:
    """`mask` [S, E] keeping per expert the `capacity` routed tokens of highest `scores`
    (zero where not routed, so unrouted tokens are never preferred over routed ones)."""
    k = int(min(int(capacity), mask.shape[0]))
    top = torch.topk(scores, k=k, dim=0, sorted=False).indices
    keep = torch.zeros_like(mask).scatter_(0, top, 1)
    return mask * keep


@dataclass
class _Routes:
    """k routes per token: expert (-1 when dropped), slot in the expert's buffer, gate weight."""

    indices: Tensor  # [k, S] int64
    locations: Tensor  # [k, S] int64
    gates: Tensor  # [k, S] fp32
    capacity: Tensor  # 0-d int64
    num_experts: int


def _routes_from_masks(masks: list[Tensor], locations: list[Tensor], gates: list[Tensor], capacity, num_experts):
    """Per-route tensors from [S, E] masks (kept routes), locations and gate values [S]."""
    indices = [torch.where(m.any(dim=1), m.argmax(dim=1), torch.full_like(m[:, 0], -1)) for m in masks]
    slots = [(loc * m).sum(dim=1) for loc, m in zip(locations, masks, strict=True)]
    return _Routes(torch.stack(indices), torch.stack(slots), torch.stack(gates), capacity, num_experts)


def _output(l_aux: Tensor, routes: _Routes, exp_counts: Tensor, sparse_routes: bool):
    if sparse_routes:
        return (
            l_aux, routes.capacity, routes.num_experts, routes.indices.to(torch.int32),
            routes.locations.to(torch.int32), routes.gates, exp_counts,
        )
    combine_weights = dense_combine_weights(routes)
    return l_aux, combine_weights, combine_weights.bool(), exp_counts


def dense_combine_weights(routes: _Routes) -> Tensor:
    """[S, E, C] with each kept route's gate at (token, expert, slot); differentiable in the gates."""
    k, num_tokens = routes.indices.shape
    num_experts, capacity = routes.num_experts, int(routes.capacity)
    scratch = num_experts * capacity  # dropped routes land on one extra column, cut below
    slots = torch.where(routes.indices >= 0, routes.indices * capacity + routes.locations, scratch)
    flat = routes.gates.new_zeros(num_tokens, scratch + 1).scatter_add(1, slots.t(), routes.gates.t())
    return flat[:, :scratch].reshape(num_tokens, num_experts, capacity)


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: object = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """Top-1 gating (Switch). `used_token` [S] masks tokens out of routing; without `use_rts`
    the first arrivals are kept (DeepSpeed's top-k over a 0/1 mask leaves that order to the
    kernel)."""
    ep_group = _as_group(ep_group)
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    if drop_tokens:
        capacity = _agreed_capacity(capacity, logits.device, ep_group)

    chooser = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask1 = F.one_hot(torch.argmax(chooser, dim=1), num_classes=num_experts)
    if used_token is not None:
        mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
    exp_counts = mask1.sum(dim=0).detach()
    if not drop_tokens:
        # DeepSpeed also clamps this to the local token count, which only matters when ranks
        # hold different token counts, and then gives the ranks different buffer sizes for
        # the all-to-all. Not clamped here; the selection below is bounded by the tokens.
        capacity = _dropless_capacity(exp_counts, ep_group)

    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.sum(me * ce) * num_experts

    if use_rts:
        mask1 = _top_per_expert(mask1, mask1 * torch.rand(mask1.shape, device=mask1.device), capacity)
    else:
        mask1 = _first_arrivals(mask1, capacity)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    gates1 = (gates * mask1).sum(dim=1)
    routes = _routes_from_masks([mask1], [locations1], [gates1], capacity, num_experts)
    return _output(l_aux, routes, exp_counts, sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: object = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """Top-2 gating (GShard). Slots: every first choice of an expert precedes its second ones."""
    ep_group = _as_group(ep_group)
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape

    mask1 = F.one_hot(torch.argmax(gates, dim=1), num_classes=num_experts)
    second = logits + gumbel_rsample(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
    second = second.masked_fill(mask1.bool(), float("-inf"))
    mask2 = F.one_hot(torch.argmax(second, dim=1), num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)

    me = gates.mean(dim=0)
    ce = mask1.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()

    if drop_tokens:
        capacity = _agreed_capacity(
            _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity), logits.device, ep_group
        )
        mask1 = mask1 * torch.lt(locations1, capacity)
        mask2 = mask2 * torch.lt(locations2, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)

    gates1 = (gates * mask1).sum(dim=1)
    gates2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    routes = _routes_from_masks(
        [mask1, mask2], [locations1, locations2], [gates1 / denom, gates2 / denom], capacity, num_experts
    )
    return _output(l_aux, routes, exp_counts, sparse_routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: object = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
):
    """Top-k gating; per token the k most probable experts, in descending probability."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy={drop_policy!r}: must be one of {DROP_POLICIES}.")
    ep_group = _as_group(ep_group)
    logits = logits.float()
    gates = F.softmax(logits, dim=1)
    num_tokens, num_experts = gates.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"k={k}: must be between 1 and the number of experts ({num_experts}).")

    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.int64).scatter_(1, top_idx, 1)
    exp_counts = mask.sum(dim=0).detach()

    me = gates.mean(dim=0)
    ce = mask.float().mean(dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts / k

    if drop_tokens:
        capacity = _agreed_capacity(
            _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity), logits.device, ep_group
        )
        if drop_policy == "probs":
            topk_masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            mask = _top_per_expert(mask, topk_masked_gates, capacity)
        else:
            mask = _first_arrivals(mask, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    locations = torch.cumsum(mask, dim=0) - 1

    kept_gates = gates * mask
    kept_gates = kept_gates / torch.clamp(kept_gates.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)

    # One route per top-k column, in the order topk ranked them.
    kept = mask.gather(1, top_idx).bool()
    routes = _Routes(
        indices=torch.where(kept, top_idx, torch.full_like(top_idx, -1)).t(),
        locations=(locations.gather(1, top_idx) * kept).t(),
        gates=kept_gates.gather(1, top_idx).t(),
        capacity=capacity,
        num_experts=num_experts,
    )
    return _output(l_aux, routes, exp_counts, sparse_routes)


class TopKGate(nn.Module):
    """The router module: a bias-free linear scorer `wg` (computed in fp32) and the gating
    function for `k` (top-1, top-2, top-k with the "probs" drop policy).

    Attributes:
        wg: the [num_experts, model_dim] scoring weight (`<moe>.deepspeed_moe.gate.wg.weight`).
        ep_group: the expert-parallel group the capacity is agreed on.
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: object = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(
                f"noisy_gate_policy={noisy_gate_policy!r}: must be one of None, 'None', 'Jitter', 'RSample'."
            )
        if not 1 <= k <= num_experts:
            raise ValueError(f"k={k}: must be between 1 and num_experts ({num_experts}). Lower k.")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = _as_group(ep_group)
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group: object) -> None:
        self.ep_group = _as_group(ep_group)

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,
                use_tutel: bool = False):
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            input_fp32 = multiplicative_jitter(input_fp32)
        logits = F.linear(input_fp32, self.wg.weight.float())
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(
                logits, capacity_factor, self.min_capacity, used_token,
                self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                self.ep_group, sparse_routes,
            )
        if self.k == 2:
            return top2gating(
                logits, capacity_factor, self.min_capacity, self.drop_tokens, self.ep_group,
                self.top2_2nd_expert_sampling, sparse_routes,
            )
        return topkgating(
            logits, self.k, capacity_factor, self.min_capacity, self.drop_tokens, self.ep_group,
            sparse_routes=sparse_routes,
        )


def __getattr__(name: str):
    # DeepSpeed's MOELayer lives at this path; here it is the dispatcher's (imported lazily,
    # the dispatcher does not need the router).
    if name == "MOELayer":
        from zeroshard.moe.dispatcher import MOELayer

        return MOELayer
    raise AttributeError(name)

