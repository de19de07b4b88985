"""A Llama-3-shaped decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP,
untied embedding and output, in the manner of torchtitan's llama3 model.

Its presets (`LLAMA_PRESETS`, zeroshard/models/presets.py) have Llama 3's published sizes, so
`zeroshard simulate --model 8b` and `zeroshard explain --model 70b` see a real model's
parameters, units and activations. It trains like the demo's GPT: `model(idx, targets)`
returns (logits, mean cross-entropy), and its repeated `layers` are the engine's units.

With a sequence group (`sequence_group=`, Ulysses sequence parallelism, docs/sequence-parallel.md)
each rank holds a contiguous slice of every sequence; attention runs through
`zeroshard.sequence.layer.DistributedAttention` and the rotary angles use the slice's global
positions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["LlamaConfig", "Llama", "LLAMA_PRESETS", "build_llama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Sizes of a Llama-3-style decoder (Llama 3 8B's by default)."""

    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention); must divide n_heads."""
    ffn_dim: int = 14336
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192
    checkpoint_activations: bool = False
    """Recompute each layer in backward (torch.utils.checkpoint, non-reentrant): activation
    memory of one layer instead of all, at the cost of a second forward."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1.")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}. Pick sizes that divide.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: each key/value head "
                "serves n_heads / n_kv_heads query heads. Pick sizes that divide."
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head size {self.dim // self.n_heads} is odd: rotary embeddings rotate pairs.")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameters of the model these sizes build (embedding and output counted apart)."""
        kv = self.n_kv_heads * self.head_dim
        attention = self.dim * self.dim * 2 + self.dim * kv * 2
        layer = attention + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * layer + 2 * self.vocab_size * self.dim + self.dim


# Llama 3's published sizes (Meta's params.json for Llama 3 / 3.1 8B and 70B; torchtitan's
# llama3 "8B" and "70B"), plus a tiny one for tests and examples.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(
        vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, max_seq_len=256
    ),
    "8b": LlamaConfig(),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


def _rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of `x` [batch, seq, heads, head_dim] by position * theta^(-2i/d).

    The angles are computed here in fp32 rather than kept as a buffer, so an engine that casts
    the model's floating buffers to bf16 cannot coarsen them."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(0, half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # (seq, half)
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    pairs = x.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)


def _sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention on [batch, seq, heads, head_dim], key/value heads shared by groups of query heads."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, sequence_group=None) -> None:
        super().__init__()
        self.config = config
        hd = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * hd, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(config.n_heads * hd, config.dim, bias=False)
        self.core = _sdpa_gqa
        if sequence_group is not None:
            from zeroshard.sequence.layer import DistributedAttention

            self.core = DistributedAttention(
                _sdpa_gqa, sequence_group, scatter_idx=2, gather_idx=1, num_kv_heads=config.n_kv_heads
            )

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        hd, theta = self.config.head_dim, self.config.rope_theta
        q = _rotary(self.wq(x).view(B, T, -1, hd), positions, theta)
        k = _rotary(self.wk(x).view(B, T, -1, hd), positions, theta)
        v = self.wv(x).view(B, T, -1, hd)
        if self.core is _sdpa_gqa:
            y = _sdpa_gqa(q, k, v)
        else:
            y = self.core(q, k, v, 0)  # batch_dim_idx 0: [batch, seq, heads, head_dim]
        return self.wo(y.reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: LlamaConfig, sequence_group=None) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config, sequence_group)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder-only transformer over token ids; `layers` holds the repeated blocks (the units)."""

    def __init__(self, config: LlamaConfig, sequence_group=None) -> None:
        super().__init__()
        self.config = config
        self.sequence_group = sequence_group
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList([TransformerBlock(config, sequence_group) for _ in range(config.n_layers)])
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, 0.02) weights; the projections into the residual stream (wo, w2) scaled by
        1/sqrt(2 n_layers) so the residual's variance does not grow with depth."""
        depth_scale = (2 * self.config.n_layers) ** -0.5
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue  # the norms' weights keep their ones
            std = 0.02 * depth_scale if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor | tuple | list, targets: torch.Tensor | None = None):
        """(logits [batch, seq, vocab], mean cross-entropy in fp32 or None), as the GPT's forward.

        `idx` is this rank's slice of the sequence under sequence parallelism; the slices are
        consecutive in rank order of the sequence group."""
        if isinstance(idx, (tuple, list)):
            idx, targets = idx
        T = idx.size(1)
        offset = 0
        if self.sequence_group is not None:
            offset = self.sequence_group.rank * T
        if offset + T > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {offset + T} exceeds max_seq_len={self.config.max_seq_len}: crop the input "
                "or build the model with a larger max_seq_len."
            )
        positions = torch.arange(offset, offset + T, device=idx.device)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            if self.config.checkpoint_activations and self.training:
                x = checkpoint(layer, x, positions, use_reentrant=False)
            else:
                x = layer(x, positions)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1))
        return logits, loss


def build_llama(preset: str, sequence_group=None, **overrides) -> Llama:
    """A Llama from a named preset, with any LlamaConfig field overridden."""
    if preset not in LLAMA_PRESETS:
        raise ValueError(f"unknown Llama preset {preset!r}; choose one of {', '.join(LLAMA_PRESETS)}.")
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown LlamaConfig field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}."
        )
    return Llama(dataclasses.replace(LLAMA_PRESETS[preset], **overrides), sequence_group)
