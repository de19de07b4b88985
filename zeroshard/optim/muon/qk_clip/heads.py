"""Which weights make each attention head's logits, per model family, and the attribute API
for custom models (see [Note: MuonClip] in qk_clip/__init__.py).

A head's pre-softmax logit is q_h . k_h * scaling. QK-clip scales it by gamma_h <= 1 by
scaling rows of the projection weights that produce q_h and k_h; `row_scales` turns the
per-query-head gammas into one factor per output row of each such weight.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

QK_CLIP_ATTR = "qk_clip_heads"  # a module's QKHeads (set by a preset or by register_qk_clip_heads)
KINDS = ("gqa", "mla", "qk_norm")


@dataclass(frozen=True)
class QKHeads:
    """The weights behind one attention module's logits.

    Attributes:
        kind: "gqa" (multi-head and grouped-query attention: `query` rows are [heads,
            head_dim], `key` rows [kv_heads, head_dim]); "mla" (DeepSeek's multi-head latent
            attention: `query` rows per head are [nope, rope], `key` is kv_b_proj with rows
            per head [nope, v]; the shared rotary key is left alone); "qk_norm" (Qwen3:
            RMSNorm per head after the projections cancels any per-head scale of them, so the
            norm weights, shared by every head, take the layer's smallest gamma).
        query, key: names of parameters relative to the module (weight and bias, if any).
        num_heads, num_kv_heads, head_dim: query heads, key heads, rows per head of `key`
            (and of `query` for "gqa").
        nope_dim, rope_dim, v_dim: MLA's per-head split.
        query_offset, key_offset: the first row of the query (key) heads in their parameters:
            0, unless query, key and value share one fused weight (nanoGPT's `c_attn`:
            query rows at 0, key rows at num_heads * head_dim).
    """

    kind: str
    query: tuple[str, ...]
    key: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    nope_dim: int = 0
    rope_dim: int = 0
    v_dim: int = 0
    query_offset: int = 0
    key_offset: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"QKHeads.kind={self.kind!r}: must be one of {', '.join(KINDS)}.")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"QKHeads: num_heads={self.num_heads} must be a positive multiple of num_kv_heads="
                f"{self.num_kv_heads} (each key head serves a group of query heads)."
            )

    def row_scales(self, gamma: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
        """Per query/key parameter name, the factor of each of its head rows (a 0-d factor for
        the whole parameter with "qk_norm") so that query head h's logits scale by exactly
        gamma[h] (gamma: [num_heads], 1.0 for heads under the threshold). A fused weight
        named as both query and key gets its key factors here (see `row_factors`).

        Grouped query: a key head shared by a group takes the group's smallest gamma to the
        power 1 - alpha, and each query head the rest of its own gamma, so heads under the
        threshold keep their logits (their query scale is 1 / the key's).
        """
        q_rows, k_rows = self._role_rows(gamma.double(), alpha)
        return {**{name: q_rows for name in self.query}, **{name: k_rows for name in self.key}}

    def row_factors(self, gamma: torch.Tensor, alpha: float, rows: dict[str, int]) -> dict[str, torch.Tensor]:
        """Per parameter name, the factor of every one of its `rows[name]` output rows: the
        query and key factors at their offsets, 1 elsewhere (a fused weight's value rows)."""
        q_rows, k_rows = self._role_rows(gamma.double(), alpha)
        full = {name: torch.ones(count, dtype=torch.float64, device=gamma.device) for name, count in rows.items()}
        for names, offset, factor in ((self.query, self.query_offset, q_rows), (self.key, self.key_offset, k_rows)):
            for name in names:
                if factor.dim() == 0:
                    full[name] *= factor
                else:
                    full[name][offset : offset + factor.numel()] = factor
        return full

    def _role_rows(self, gamma: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "qk_norm":
            g = gamma.min()
            return g**alpha, g ** (1.0 - alpha)
        if self.kind == "mla":
            q = torch.stack([gamma**alpha, gamma], dim=1).repeat_interleave(
                torch.tensor([self.nope_dim, self.rope_dim], device=gamma.device), dim=1)
            k = torch.stack([gamma ** (1.0 - alpha), torch.ones_like(gamma)], dim=1).repeat_interleave(
                torch.tensor([self.nope_dim, self.v_dim], device=gamma.device), dim=1)
            return q.reshape(-1), k.reshape(-1)
        group = self.num_heads // self.num_kv_heads
        key_factor = gamma.view(self.num_kv_heads, group).amin(dim=1) ** (1.0 - alpha)
        query_factor = gamma / key_factor.repeat_interleave(group)
        return query_factor.repeat_interleave(self.head_dim), key_factor.repeat_interleave(self.head_dim)


def register_qk_clip_heads(
    module: nn.Module, query: str | tuple[str, ...], key: str | tuple[str, ...], num_heads: int,
    head_dim: int, num_kv_heads: int | None = None, query_offset: int = 0, key_offset: int = 0,
) -> QKHeads:
    """Tell MuonClip which weights make a custom attention module's logits (multi-head or
    grouped-query: the query weight's output rows are [num_heads, head_dim], the key's
    [num_kv_heads, head_dim], from row `query_offset` / `key_offset` when query, key and value
    share one fused weight). The module must report its logits: call it with the module as
    the first argument of a Hugging Face attention function, or call
    `zeroshard.optim.muon.qk_clip.record_logits(module, query, key, scaling)` in its forward.

    Example:
        register_qk_clip_heads(block.attn, query="wq.weight", key="wk.weight", num_heads=8, head_dim=64)
    """
    heads = QKHeads(
        "gqa", (query,) if isinstance(query, str) else tuple(query), (key,) if isinstance(key, str) else tuple(key),
        num_heads, num_kv_heads or num_heads, head_dim, query_offset=query_offset, key_offset=key_offset,
    )
    for name in heads.query + heads.key:
        _parameter(module, name)
    setattr(module, QK_CLIP_ATTR, heads)
    return heads


def _parameter(module: nn.Module, name: str) -> nn.Parameter:
    try:
        p = module.get_parameter(name)
    except AttributeError as exc:
        raise ValueError(
            f"QK-clip: {type(module).__name__} has no parameter {name!r} ({exc}). Name the query and key "
            "projection parameters relative to the attention module, e.g. 'q_proj.weight'."
        ) from None
    return p


def _linear_names(module: nn.Module, *names: str) -> tuple[str, ...]:
    out = []
    for name in names:
        linear = getattr(module, name)
        out.append(f"{name}.weight")
        if getattr(linear, "bias", None) is not None:
            out.append(f"{name}.bias")
    return tuple(out)


def _gqa_preset(module: nn.Module) -> QKHeads:
    config = module.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(module, "head_dim", None) or config.hidden_size // heads
    if getattr(module, "q_norm", None) is not None and getattr(module, "k_norm", None) is not None:
        return QKHeads("qk_norm", ("q_norm.weight",), ("k_norm.weight",), heads, kv_heads, head_dim)
    return QKHeads("gqa", _linear_names(module, "q_proj"), _linear_names(module, "k_proj"), heads, kv_heads, head_dim)


def _mla_preset(module: nn.Module) -> QKHeads:
    query = "q_proj" if getattr(module, "q_proj", None) is not None else "q_b_proj"
    if getattr(module.kv_b_proj, "bias", None) is not None or getattr(getattr(module, query), "bias", None) is not None:
        raise ValueError(f"QK-clip: {type(module).__name__} has biased MLA up-projections, which no preset covers.")
    return QKHeads(
        "mla", (f"{query}.weight",), ("kv_b_proj.weight",), module.num_heads, module.num_heads,
        nope_dim=module.qk_nope_head_dim, rope_dim=module.qk_rope_head_dim, v_dim=module.v_head_dim,
    )


# Hugging Face attention classes by name: Llama, Mistral, Mixtral, Qwen2/Qwen2-MoE (biased
# q/k), Qwen3 and Qwen3-MoE (QK-norm), DeepSeek-V3 (MLA).
PRESETS = {
    "LlamaAttention": _gqa_preset,
    "MistralAttention": _gqa_preset,
    "MixtralAttention": _gqa_preset,
    "Qwen2Attention": _gqa_preset,
    "Qwen2MoeAttention": _gqa_preset,
    "Qwen3Attention": _gqa_preset,
    "Qwen3MoeAttention": _gqa_preset,
    "DeepseekV3Attention": _mla_preset,
}


def attention_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, QKHeads]]:
    """Every attention module MuonClip acts on: registered ones, then the presets' classes
    (a preset's description is stored on the module, so later calls see it as registered)."""
    for name, module in model.named_modules():
        heads = getattr(module, QK_CLIP_ATTR, None)
        if heads is None and type(module).__name__ in PRESETS:
            heads = PRESETS[type(module).__name__](module)
            setattr(module, QK_CLIP_ATTR, heads)
        if heads is not None:
            for pname in heads.query + heads.key:
                _parameter(module, pname)
            yield name, module, heads
