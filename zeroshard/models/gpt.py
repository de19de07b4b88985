"""A small GPT in the manner of nanoGPT, for the demo, `explain --model` and the benchmarks.

The repeated `Block`s sit in one `nn.ModuleList`, so the engine's automatic rule makes each
block a ZeRO unit; the embeddings, the final LayerNorm and the tied lm head form the root unit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroshard.optim.muon.qk_clip import record_logits, register_qk_clip_heads

BYTE_VOCAB_SIZE = 256


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. Every preset reads bytes, so `vocab_size` is 256."""

    vocab_size: int = BYTE_VOCAB_SIZE
    block_size: int = 128
    """Longest context the position embedding covers."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""
    moe_num_experts: int = 0
    """0: a dense MLP per block. N > 0: each block's MLP becomes a Mixture of Experts of N
    MLPs (zeroshard.moe.layer.MoE, DeepSpeed's layer), spread over `moe_ep_size` ranks."""
    moe_ep_size: int = 1
    moe_k: int = 1
    """Experts per token."""
    moe_aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss added to the cross-entropy."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them
    (`torch.utils.checkpoint`, non-reentrant): a block keeps only its input."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                "each head gets n_embd // n_head channels. Pick sizes that divide."
            )
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1.")
        if self.moe_num_experts < 0:
            raise ValueError(f"moe_num_experts={self.moe_num_experts}: must be 0 (dense) or a number of experts.")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout}: must be in [0, 1).")


# Parameter counts are for the weights (the tied embedding counted once).
PRESETS: dict[str, GPTConfig] = {
    # ~0.21M: fast enough for tests that spawn processes.
    "tiny": GPTConfig(block_size=64, n_layer=4, n_head=4, n_embd=64),
    # ~1.2M: the demo default; learns visible structure in minutes on 2 CPU cores.
    "small": GPTConfig(block_size=128, n_layer=6, n_head=4, n_embd=128),
    # ~10.7M
    "medium": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
    # GPT-2 small's shape (85M with a byte vocabulary); for `explain` memory estimates.
    "gpt2-124m": GPTConfig(block_size=1024, n_layer=12, n_head=12, n_embd=768),
    # ~1.0B; for `explain` memory estimates only.
    "1b": GPTConfig(block_size=2048, n_layer=20, n_head=16, n_embd=2048),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        # query, key and value for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # MuonClip (qk_clip in the Muon config) knows the fused layout: query rows first, then key.
        head_dim = config.n_embd // config.n_head
        fused = ("c_attn.weight", "c_attn.bias") if config.bias else "c_attn.weight"
        register_qk_clip_heads(self, fused, fused, config.n_head, head_dim, key_offset=config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        record_logits(self, q, k, is_causal=True)  # a no-op unless qk_clip is on
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp: nn.Module = MLP(config)
        self.aux_loss: torch.Tensor | None = None  # the MoE layer's load-balancing loss, last forward
        if config.moe_num_experts:
            from zeroshard.moe.layer import MoE

            self.mlp = MoE(
                config.n_embd, self.mlp, num_experts=config.moe_num_experts, ep_size=config.moe_ep_size,
                k=config.moe_k,
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out = self.mlp(self.ln_2(x))
        if isinstance(out, tuple):  # MoE: (output, l_aux, exp_counts)
            out, self.aux_loss, _ = out
        return x + out


def split_batch(
    idx: torch.Tensor | tuple | list, targets: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Accept either `(idx, targets)` or one `(x, y)` batch as a data loader yields it.

    This lets a DeepSpeed-style loop call `engine(batch)` as well as `engine(x, y)`.
    """
    if isinstance(idx, (tuple, list)):
        if targets is not None or len(idx) != 2:
            raise ValueError(
                "GPT.forward takes (idx, targets) or one (x, y) batch, "
                f"got a {type(idx).__name__} of length {len(idx)} and targets={targets is not None}."
            )
        return idx[0], idx[1]
    return idx, targets


class GPT(nn.Module):
    """Decoder-only transformer over bytes, with the lm head tied to the token embedding."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one tensor serves as both; it is one parameter, not a copy.
        self.lm_head.weight = self.wte.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's init. Deterministic for a given torch.manual_seed (modules are visited in order)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        # Residual projections are scaled down so the residual stream's variance does not
        # grow with depth (GPT-2 paper); each block adds two of them.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def num_params(self) -> int:
        """Number of distinct parameter elements (the tied weight counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor | tuple | list, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy when targets are given.

        Args:
            idx: int64 byte ids, shape (B, T) with T <= block_size; or an (x, y) batch.
            targets: int64 next-byte ids, shape (B, T), or None.

        Returns:
            (logits of shape (B, T, vocab_size), loss as a 0-d fp32 tensor or None).
        """
        idx, targets = split_batch(idx, targets)
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size={self.config.block_size}: "
                "crop the input or build the model with a larger block_size."
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            if self.config.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        # The loss is taken in fp32 even when the model computes in bf16/fp16: the log-softmax
        # over 256 classes is cheap and its rounding would otherwise show in the loss curve.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        if self.config.moe_num_experts:
            loss = loss + self.config.moe_aux_loss_coef * sum(b.aux_loss.float() for b in self.blocks)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend `idx` (B, T) by `max_new_tokens` sampled bytes; returns (B, T + max_new_tokens).

        Pass a seeded `generator` to get the same sample on every rank.
        """
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: must be > 0.")
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # the context the model can see
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits[logits < kth] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            # Sample on CPU with the caller's generator, so every device gives the same draw.
            next_id = torch.multinomial(probs.cpu(), num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id.to(idx.device)), dim=1)
        return idx


def build_gpt(preset: str, **overrides) -> GPT:
    """Build a GPT from a named preset, with any GPTConfig field overridden.

    Example: `build_gpt("small", n_layer=8)`.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}.")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GPTConfig field(s) {', '.join(unknown)}; the fields are {', '.join(sorted(known))}.")
    return GPT(dataclasses.replace(PRESETS[preset], **overrides))
