"""S_max: each head's largest pre-softmax logit over a step's training forwards.

Hugging Face attention modules call their attention function with themselves as the first
argument; `install_capture` wraps transformers' SDPA entry and each model file's
`eager_attention_forward` once per process with a function that, for a module carrying a
`LogitMax`, records the per-head maximum and then runs the attention unchanged (a module
without one passes straight through). The maximum is computed here, chunked over query rows,
so no full [batch, heads, q, k] logit matrix exists at once (SDPA never builds one either);
it costs one extra Q.K^T product in the forward (no backward), see docs/muon.md.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

RECORDER_ATTR = "_zeroshard_logit_max"
CHUNK_ELEMENTS = 1 << 22  # logits per chunk (16 MiB in fp32): small beside the activations
CAUSAL_ROWS = 128  # query rows per chunk under a causal mask
_WRAPPED = "_zeroshard_qk_clip_wrapped"


class LogitMax:
    """A module's running per-head maximum logit (a device tensor; no host sync)."""

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads
        self.value: torch.Tensor | None = None

    def observe(self, per_head: torch.Tensor) -> None:
        if per_head.shape != (self.num_heads,):
            raise ValueError(
                f"QK-clip: logits of {per_head.shape[0]} heads recorded for a module registered with "
                f"{self.num_heads}. Register the module with its number of query heads."
            )
        per_head = per_head.detach().float()
        self.value = per_head.clone() if self.value is None else torch.maximum(self.value, per_head)

    def take(self, device: torch.device) -> torch.Tensor:
        """The maximum since the last take (-inf for heads never seen), and reset."""
        value = self.value if self.value is not None else torch.full((self.num_heads,), float("-inf"))
        self.value = None
        return value.to(device)


@torch.no_grad()
def max_logits(
    query: torch.Tensor, key: torch.Tensor, scaling: float | None = None, attention_mask: torch.Tensor | None = None,
    is_causal: bool = False, chunk_elements: int = CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Per query head, max over batch, query and (unmasked) key positions of q.k * scaling.

    query: [batch, heads, q, d]; key: [batch, kv_heads, k, d] (a key head serves heads /
    kv_heads consecutive query heads, as repeat_kv assumes); attention_mask: boolean (True
    attends) or additive, broadcastable to [batch, heads, q, k]; is_causal: key j > query i
    masked (SDPA's top-left alignment). Returns [heads] in fp32, computed `chunk_elements`
    logits at a time.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scaling = dim ** -0.5 if scaling is None else float(scaling)
    q = query.detach()
    kt = key.detach().transpose(-1, -2)  # [b, kv, d, k]: one plain batched product per chunk
    mask5 = None
    if attention_mask is not None:
        m = attention_mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        m = m[..., :k_len]
        # [b|1, kv|1, g|1, q|1, k], to mask the logits viewed as [b, kv, g, rows, k]
        mask5 = m.reshape(m.shape[0], kv_heads, group, *m.shape[2:]) if m.shape[1] == heads else m.unsqueeze(2)
    rows = max(1, chunk_elements // max(1, batch * heads * k_len))
    causal_only = is_causal and mask5 is None
    if causal_only:
        rows = min(rows, CAUSAL_ROWS)  # smaller chunks skip more of the masked upper triangle
    best = torch.full((heads,), float("-inf"), device=query.device)
    for start in range(0, q_len, rows):
        stop = min(q_len, start + rows)
        chunk = stop - start
        # Query heads of one key head are consecutive: [b, kv, g * rows, d] against its key.
        qc = q[:, :, start:stop, :].reshape(batch, kv_heads, group * chunk, dim)
        # Causal: keys after the chunk's last query are masked for all of it; not computed.
        keys = min(k_len, stop) if causal_only else k_len
        logits = torch.matmul(qc, kt[..., :keys]).view(batch, kv_heads, group, chunk, keys)
        additive = mask5 is not None and mask5.dtype != torch.bool
        if mask5 is not None:
            part = mask5[..., start:stop, :] if mask5.shape[-2] > 1 else mask5
            if additive:
                logits = logits * scaling + part
            else:
                logits.masked_fill_(~part, float("-inf"))
        if is_causal:  # only the chunk's diagonal block holds masked positions
            first = start if causal_only else 0
            i = torch.arange(start, stop, device=query.device).unsqueeze(1)
            j = torch.arange(first, keys, device=query.device)
            logits[..., first:keys].masked_fill_(j > i, float("-inf"))
        per_head = logits.reshape(batch, kv_heads, group, chunk * keys).amax(dim=-1).amax(dim=0).reshape(heads).float()
        if not additive:
            per_head = per_head * scaling  # scaling > 0: the max of the scaled logits
        best = torch.maximum(best, per_head)
    return best


def _watched_training_forward(module: nn.Module) -> bool:
    """QK-clip watches `module` and this is a training forward: the module in train mode and
    grad enabled (docs/muon.md). A forward under torch.no_grad() in train mode (an evaluation
    that forgot eval(), a generation) must not move the next step's clip; under reentrant
    activation checkpointing the logits are recorded by the recomputation, which sees the same
    ones (the first forward runs without grad), and recording them twice changes no maximum."""
    return getattr(module, RECORDER_ATTR, None) is not None and module.training and torch.is_grad_enabled()


def record_logits(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None = None,
    attention_mask: torch.Tensor | None = None, is_causal: bool = False,
) -> None:
    """Record a training forward's logits of `module` (a no-op unless QK-clip watches it and the
    forward is a training one: train mode, grad enabled). Custom attention modules call this
    with the query and key their attention uses."""
    if not _watched_training_forward(module):
        return
    recorder = getattr(module, RECORDER_ATTR)
    recorder.observe(max_logits(query, key, scaling, attention_mask, is_causal))


def _sdpa_causal(module: nn.Module, query: torch.Tensor, mask: Any, kwargs: dict[str, Any]) -> bool:
    """transformers' sdpa_attention_forward's own rule for SDPA's is_causal flag."""
    flag = kwargs.get("is_causal")
    flag = flag if flag is not None else getattr(module, "is_causal", True)
    return bool(query.shape[2] > 1 and mask is None and flag)


def _wrap(attention: Callable, sdpa: bool) -> Callable:
    if getattr(attention, _WRAPPED, False):
        return attention

    @functools.wraps(attention)
    def attention_with_logit_max(module, query, key, value, attention_mask, *args, **kwargs):
        if _watched_training_forward(module):
            scaling = kwargs.get("scaling")
            causal = _sdpa_causal(module, query, attention_mask, kwargs) if sdpa else False
            record_logits(module, query, key, scaling, attention_mask, causal)
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    setattr(attention_with_logit_max, _WRAPPED, True)
    return attention_with_logit_max


def install_capture(modules: list[nn.Module], num_heads: list[int]) -> None:
    """Give each module a `LogitMax` and make sure its attention function reports to it."""
    for module, heads in zip(modules, num_heads, strict=True):
        setattr(module, RECORDER_ATTR, LogitMax(heads))
        model_file = sys.modules.get(type(module).__module__)
        eager = getattr(model_file, "eager_attention_forward", None)
        if eager is not None:
            model_file.eager_attention_forward = _wrap(eager, sdpa=False)
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:  # no transformers: custom modules call record_logits themselves
        return
    sdpa = AttentionInterface._global_mapping.get("sdpa")
    if sdpa is not None:
        AttentionInterface.register("sdpa", _wrap(sdpa, sdpa=True))
