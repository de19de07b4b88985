"""Small MoE models laid out as Hugging Face remote code and transformers 4 lay them out, with
their forward written here from the models' published routing (no hub, no transformers):

* `remote_deepseek_v3()`: DeepSeek-V3 / Moonlight as `trust_remote_code` loads them:
  `model.layers.<i>.mlp.experts` an nn.ModuleList of MLPs with `gate_proj`/`up_proj`/
  `down_proj`, the gate's `weight` and `e_score_correction_bias` nn.Parameters, sigmoid scores,
  the bias added for the choice only, groups scored by their two best experts, the unbiased
  scores of the chosen experts renormalised and scaled; a dense first layer and a shared
  expert.
* `stacked_deepseek_v3()`: the same with each block's experts stacked under those names
  (`experts.gate_proj` [E, ffn, H], ...), a layout between the two;
* `modulelist_mixtral()`: transformers 4's Mixtral: `block_sparse_moe.experts` would be the
  name there; here the block is `mlp` (AutoEP's default pattern) with a Linear router `gate`
  and experts with `w1` (gate), `w3` (up), `w2` (down); softmax, top-k, renormalised.

Both compute the experts token by token in a Python loop, so they share no code with AutoEP's
stacked, exchanged experts. Routing is in fp32 as the originals do it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, VOCAB = 16, 32


@dataclass
class RemoteDeepseekConfig:
    model_type: str = "deepseek_v3"
    hidden_size: int = HIDDEN
    intermediate_size: int = 24
    moe_intermediate_size: int = 8
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    num_hidden_layers: int = 3
    first_k_dense_replace: int = 1


@dataclass
class MixtralV4Config:
    model_type: str = "mixtral"
    hidden_size: int = HIDDEN
    intermediate_size: int = 12
    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    num_hidden_layers: int = 2


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoEGate(nn.Module):
    """The remote code's router: both tensors are parameters."""

    def __init__(self, config: RemoteDeepseekConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.empty(config.n_routed_experts))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        scores = F.linear(tokens.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(tokens.shape[0], c.n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        best_groups = group_scores.topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores).scatter_(1, best_groups, 1.0).bool()
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens.shape[0], -1)
        index = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weight = scores.gather(1, index)
        if c.norm_topk_prob:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return index, weight * c.routed_scaling_factor


class RemoteDeepseekMoE(nn.Module):
    def __init__(self, config: RemoteDeepseekConfig) -> None:
        super().__init__()
        inner = config.moe_intermediate_size
        self.experts = nn.ModuleList([MLP(config.hidden_size, inner) for _ in range(config.n_routed_experts)])
        self.gate = MoEGate(config)
        self.shared_experts = MLP(config.hidden_size, inner * config.n_shared_experts)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        index, weight = self.gate(tokens)
        return (_per_token(tokens, self.experts, index, weight) + self.shared_experts(tokens)).view(hidden.shape)


class MixtralV4Expert(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class MixtralV4MoE(nn.Module):
    def __init__(self, config: MixtralV4Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(
            [MixtralV4Expert(config.hidden_size, config.intermediate_size) for _ in range(config.num_local_experts)]
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weight, index = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        return _per_token(tokens, self.experts, index, weight).view(hidden.shape)


class StackedExperts(nn.Module):
    """Every expert's weights stacked, under the per-expert names: `gate_proj` / `up_proj`
    [E, ffn, H], `down_proj` [E, H, ffn]. `experts[e]` is expert e's function."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self.gate_proj = nn.Parameter(torch.stack([e.gate_proj.weight.detach() for e in experts]))
        self.up_proj = nn.Parameter(torch.stack([e.up_proj.weight.detach() for e in experts]))
        self.down_proj = nn.Parameter(torch.stack([e.down_proj.weight.detach() for e in experts]))
        self.act_fn = nn.SiLU()

    def __getitem__(self, e: int):
        def expert(x: torch.Tensor) -> torch.Tensor:
            hidden = self.act_fn(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e])
            return F.linear(hidden, self.down_proj[e])

        return expert


def _per_token(tokens: torch.Tensor, experts: nn.ModuleList, index: torch.Tensor, weight: torch.Tensor):
    rows = []
    for t in range(tokens.shape[0]):
        row = torch.zeros_like(tokens[t])
        for slot in range(index.shape[1]):
            row = row + weight[t, slot].to(tokens.dtype) * experts[int(index[t, slot])](tokens[t])
        rows.append(row)
    return torch.stack(rows)


class Layer(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mlp = mlp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class Inner(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(layers)


class CausalLM(nn.Module):
    """`model.layers.<i>.mlp` as the Hugging Face models name their blocks; `config` as they
    carry it. forward(input_ids, labels=None) -> logits, or the next-token loss with labels."""

    def __init__(self, config, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.model = Inner(layers)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h)
        logits = self.lm_head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), labels[:, 1:].reshape(-1))


def _init(model: nn.Module, seed: int) -> nn.Module:
    """Every weight drawn; routers large so routing is far from uniform, the selection bias
    large enough to change choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.3 if "bias" in name else 0.8 if name.endswith("gate.weight") else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def remote_deepseek_v3(seed: int = 0) -> CausalLM:
    config = RemoteDeepseekConfig()
    layers = [
        Layer(MLP(HIDDEN, config.intermediate_size) if i < config.first_k_dense_replace else RemoteDeepseekMoE(config))
        for i in range(config.num_hidden_layers)
    ]
    return _init(CausalLM(config, layers), seed)


def modulelist_mixtral(seed: int = 0) -> CausalLM:
    config = MixtralV4Config()
    return _init(CausalLM(config, [Layer(MixtralV4MoE(config)) for _ in range(config.num_hidden_layers)]), seed)


def stacked_deepseek_v3(seed: int = 0) -> CausalLM:
    """`remote_deepseek_v3(seed)` with each block's experts stacked (`StackedExperts`)."""
    model = remote_deepseek_v3(seed)
    for layer in model.model.layers:
        if isinstance(layer.mlp, RemoteDeepseekMoE):
            layer.mlp.experts = StackedExperts(layer.mlp.experts)
    return model
