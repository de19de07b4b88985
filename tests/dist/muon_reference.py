"""A float64 one-process Muon step and QK-clip, written from the formulas (issue 26), for the
Muon tests: independent of zeroshard.optim.

Muon:  m <- beta m + (1 - beta) g;  u <- (1 - beta) g + beta m;  O <- NS(u) sqrt(max(1, r/c))
       per matrix (per expert of a 3-D stack, (out, rest) for 4-D);  p <- p (1 - lr wd) - lr O.
AdamW: torch's, with bias correction.
QK-clip: gamma_h = tau / S_h where S_h > tau (else 1); multi-head/grouped-query: a key head
       scales by min(gamma over its query heads)^(1 - alpha), each query head by gamma_h over
       that; MLA: per head q nope by gamma^alpha, q rope by gamma, k nope by gamma^(1 - alpha).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tests.dist.ns_reference import reference_newton_schulz


def is_muon(name: str, p: torch.Tensor) -> bool:
    components = set(name.split("."))
    return p.dim() >= 2 and "embed" not in name and "lm_head" not in name and not components & {"gate", "router"}


def orthogonalized(u: torch.Tensor) -> torch.Tensor:
    if u.dim() == 3:
        return torch.stack([orthogonalized(e) for e in u])
    matrix = u.reshape(u.shape[0], -1)
    return (reference_newton_schulz(matrix) * math.sqrt(max(1.0, matrix.shape[0] / matrix.shape[1]))).reshape(u.shape)


def clip_grads(grads: dict[str, torch.Tensor], clip: float) -> dict[str, torch.Tensor]:
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
    if clip > 0 and clip / (norm + 1e-6) < 1:
        return {n: g * (clip / (norm + 1e-6)) for n, g in grads.items()}
    return grads


def muon_step(values: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: dict[str, dict], step: int,
              hp: dict, muon_rule: Callable[[str, torch.Tensor], bool] = is_muon,
              blocks: dict[str, tuple[int, int]] | None = None) -> None:
    """One step in place on float64 `values`. hp: muon_lr, adam_lr, momentum, weight_decay, betas,
    eps. `blocks`: name -> (count, axis) for per-head Muon (each block orthogonalized alone)."""
    b1, b2 = hp["betas"]
    for n, value in values.items():
        g, s = grads[n].double(), state.setdefault(n, {})
        if muon_rule(n, value):
            s["m"] = hp["momentum"] * s.get("m", torch.zeros_like(g)) + (1 - hp["momentum"]) * g
            u = (1 - hp["momentum"]) * g + hp["momentum"] * s["m"]
            if blocks and n in blocks:
                count, axis = blocks[n]
                o = torch.cat([orthogonalized(b) for b in u.chunk(count, dim=axis)], dim=axis)
            else:
                o = orthogonalized(u)
            values[n] = value * (1 - hp["muon_lr"] * hp["weight_decay"]) - hp["muon_lr"] * o
        else:
            s["m1"] = b1 * s.get("m1", torch.zeros_like(g)) + (1 - b1) * g
            s["v"] = b2 * s.get("v", torch.zeros_like(g)) + (1 - b2) * g * g
            m_hat, v_hat = s["m1"] / (1 - b1**step), s["v"] / (1 - b2**step)
            step_size = hp["adam_lr"] * m_hat / (v_hat.sqrt() + hp["eps"])
            values[n] = value * (1 - hp["adam_lr"] * hp["weight_decay"]) - step_size


def gamma_of(s_max: torch.Tensor, tau: float) -> torch.Tensor:
    s_max = s_max.double()
    return torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))


def gqa_clip(q: torch.Tensor, k: torch.Tensor, gamma: torch.Tensor, kv_heads: int, alpha: float) -> tuple:
    """q [H*d, ...], k [Hkv*d, ...] (weights or biases) rescaled per head."""
    heads = gamma.numel()
    group = heads // kv_heads
    q, k = q.clone(), k.clone()
    qd, kd = q.shape[0] // heads, k.shape[0] // kv_heads
    for j in range(kv_heads):
        key_factor = min(gamma[j * group + i].item() for i in range(group)) ** (1 - alpha)
        k[j * kd : (j + 1) * kd] *= key_factor
        for i in range(j * group, (j + 1) * group):
            q[i * qd : (i + 1) * qd] *= gamma[i].item() / key_factor
    return q, k


def mla_clip(q_b: torch.Tensor, kv_b: torch.Tensor, gamma: torch.Tensor, nope: int, rope: int, v: int,
             alpha: float) -> tuple:
    q_b, kv_b = q_b.clone(), kv_b.clone()
    for h, g in enumerate(gamma.tolist()):
        q0, k0 = h * (nope + rope), h * (nope + v)
        q_b[q0 : q0 + nope] *= g**alpha
        q_b[q0 + nope : q0 + nope + rope] *= g
        kv_b[k0 : k0 + nope] *= g ** (1 - alpha)
    return q_b, kv_b


def eager_logit_max(query: torch.Tensor, key: torch.Tensor, scaling: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Per head, the full logit matrix's max (the eager formula: repeat the key heads, add the mask)."""
    group = query.shape[1] // key.shape[1]
    logits = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    else:  # causal
        lq, lk = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))
