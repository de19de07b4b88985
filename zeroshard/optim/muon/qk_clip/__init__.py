"""MuonClip (QK-clip, as Kimi K2 describes it): keep every attention head's largest
pre-softmax logit at or below a threshold by rescaling its query and key weights after each
optimizer step.

[Note: MuonClip]
Config, under the Muon optimizer's params: `"qk_clip": {"enabled": true, "threshold": 100.0,
"alpha": 0.5}` (settings.py).

Measured (capture.py): S_max per query head = the largest q.k * scaling over the unmasked
positions of every training forward of the step (all micro-batches), taken where the
attention function runs (Hugging Face eager and SDPA, or `record_logits` in a custom
module), chunked over query rows so the whole logit matrix never exists at once.

Reduced (clip.py): one all-reduce with MAX over the layout's world, which holds every rank
that sees a different part of the batch (data-parallel, replica, expert-parallel ranks).
Sequence parallelism is refused for now (Ulysses attention sees a subset of the heads).

Applied (clip.py, run at the end of ShardedMuon.step, before the masters are published):
gamma_h = tau / S_max_h for heads over tau, 1 for the rest, and each query/key row of the
master weights is multiplied by its factor (heads.py `QKHeads.row_scales`) where this rank
holds it: the whole master at stage 0, the shard at stages 1-3, on the host with offload,
the fp32 master under bf16 (published to the bf16 parameters right after).
  multi-head:    q_h by gamma^alpha, k_h by gamma^(1 - alpha)
  grouped-query: a key head takes min(gamma over its query group)^(1 - alpha), each query
                 head gamma_h / that, so each head's logits scale by exactly its own gamma
  MLA:           q_h's nope rows by gamma^alpha, its rope rows by gamma; k_h's nope rows
                 (kv_b_proj) by gamma^(1 - alpha); the shared rotary key is untouched
  QK-norm:       (Qwen3) the norm weights are shared by every head and undo any per-head
                 scale of the projections: the layer's smallest gamma goes on q_norm/k_norm
The momentum is not rescaled (as in Kimi K2).

Files: settings.py (the config key), heads.py (which weights, presets, the attribute API),
capture.py (S_max), clip.py (reduce and rescale), attach.py (engine set-up).
"""

from zeroshard.optim.muon.qk_clip.capture import max_logits, record_logits
from zeroshard.optim.muon.qk_clip.heads import QKHeads, attention_modules, register_qk_clip_heads
from zeroshard.optim.muon.qk_clip.settings import QKClipSettings, parse_qk_clip

__all__ = [
    "QKClipSettings",
    "QKHeads",
    "attention_modules",
    "max_logits",
    "parse_qk_clip",
    "record_logits",
    "register_qk_clip_heads",
]
