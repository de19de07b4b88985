"""MuonClip's parts on one process: the config key, the chunked S_max against the full eager
logit matrix, and the per-row factors against the logits they must produce."""

from __future__ import annotations

import pytest
import torch

from zeroshard.config.schema import ConfigError
from zeroshard.optim.muon.qk_clip import QKHeads, max_logits, parse_qk_clip, register_qk_clip_heads
from zeroshard.resolve import resolve_config


def _muon(qk_clip) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": {"qk_clip": qk_clip}}}


def test_config_accepts_the_documented_key():
    cfg = resolve_config(_muon({"enabled": True, "threshold": 50.0, "alpha": 0.25}))
    settings = parse_qk_clip(cfg.optimizer.params["qk_clip"])
    assert (settings.enabled, settings.threshold, settings.alpha) == (True, 50.0, 0.25)
    assert parse_qk_clip(None).enabled is False
    assert parse_qk_clip({"enabled": True}).threshold == 100.0


@pytest.mark.parametrize("value, words", [
    ({"enabled": True, "threshold": 0}, ["qk_clip.threshold=0", "> 0"]),
    ({"enabled": True, "alpha": 1.5}, ["qk_clip.alpha=1.5", "[0, 1]"]),
    ({"enabled": "yes"}, ["qk_clip.enabled='yes'", "true or false"]),
    ({"enabled": True, "treshold": 10}, ["qk_clip.treshold: unknown key", "threshold"]),
    (True, ["qk_clip=True", "must be an object"]),
])
def test_config_errors_name_the_key_and_the_fix(value, words):
    with pytest.raises(ConfigError) as info:
        resolve_config(_muon(value))
    for word in words:
        assert word in str(info.value), str(info.value)


def _full_max(query, key, scaling, mask=None, causal=False):
    group = query.shape[1] // key.shape[1]
    logits = (query.double() @ key.double().repeat_interleave(group, 1).transpose(-1, -2)) * scaling
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.double()
    if causal:
        lq, lk = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return logits.amax(dim=(0, 2, 3))


@pytest.mark.parametrize("chunk", [1, 50, 1 << 22])  # one query row per chunk .. everything at once
def test_chunked_max_equals_the_full_logit_matrix(chunk):
    torch.manual_seed(0)
    q, k = torch.randn(2, 6, 9, 8), torch.randn(2, 3, 9, 8)  # GQA: 2 query heads per key head
    bool_mask = torch.rand(2, 1, 9, 9) > 0.3
    bool_mask[..., 0] = True  # every row attends somewhere
    additive = torch.where(bool_mask, 0.0, -1e4).float()
    for mask, causal in ((None, True), (None, False), (bool_mask, False), (additive, False)):
        got = max_logits(q, k, 0.35, mask, causal, chunk_elements=chunk)
        torch.testing.assert_close(got.double(), _full_max(q, k, 0.35, mask, causal), rtol=1e-6, atol=1e-6)


def _logits(heads: QKHeads, wq, wk, x, k_rope=None):
    """Per query head, the logits x W_q^T . (x W_k^T)^T for GQA, or MLA's nope+rope split."""
    if heads.kind == "mla":
        q = (x @ wq.T).view(-1, heads.num_heads, heads.nope_dim + heads.rope_dim)
        kv = (x @ wk.T).view(-1, heads.num_heads, heads.nope_dim + heads.v_dim)[..., : heads.nope_dim]
        nope = torch.einsum("shd,thd->hst", q[..., : heads.nope_dim], kv)
        return nope + torch.einsum("shd,td->hst", q[..., heads.nope_dim :], k_rope)
    q = (x @ wq.T).view(-1, heads.num_heads, heads.head_dim)
    k = (x @ wk.T).view(-1, heads.num_kv_heads, heads.head_dim).repeat_interleave(
        heads.num_heads // heads.num_kv_heads, 1)
    return torch.einsum("shd,thd->hst", q, k)


@pytest.mark.parametrize("alpha", [0.5, 0.0, 0.8])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mla"])
def test_row_factors_scale_each_heads_logits_by_its_own_gamma(kind, alpha):
    torch.manual_seed(1)
    x = torch.randn(5, 12, dtype=torch.float64)
    gamma = torch.tensor([0.5, 1.0, 0.25, 1.0], dtype=torch.float64)  # heads 1, 3 under tau
    k_rope = None
    if kind == "mla":
        heads = QKHeads("mla", ("q",), ("k",), 4, 4, nope_dim=3, rope_dim=2, v_dim=4)
        wq, wk, k_rope = torch.randn(4 * 5, 12).double(), torch.randn(4 * 7, 12).double(), torch.randn(5, 2).double()
    else:
        kv = 4 if kind == "mha" else 2
        heads = QKHeads("gqa", ("q",), ("k",), 4, kv, head_dim=3)
        wq, wk = torch.randn(12, 12).double(), torch.randn(kv * 3, 12).double()
    factors = heads.row_scales(gamma, alpha)
    before = _logits(heads, wq, wk, x, k_rope)
    after = _logits(heads, wq * factors["q"].unsqueeze(1), wk * factors["k"].unsqueeze(1), x, k_rope)
    torch.testing.assert_close(after, before * gamma.view(-1, 1, 1), rtol=1e-12, atol=1e-12)
    if kind == "mha":  # Kimi K2's split: query by gamma^alpha, key by gamma^(1 - alpha)
        torch.testing.assert_close(factors["q"].view(4, 3)[:, 0], gamma**alpha)
        torch.testing.assert_close(factors["k"].view(4, 3)[:, 0], gamma ** (1 - alpha))


def test_register_refuses_a_missing_parameter():
    attn = torch.nn.Module()
    attn.wq = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="no parameter 'wk.weight'"):
        register_qk_clip_heads(attn, query="wq.weight", key="wk.weight", num_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        QKHeads("gqa", ("wq.weight",), ("wq.weight",), 3, 2, 4)


def test_fused_qkv_of_the_demo_model_scales_query_and_key_rows_only():
    """nanoGPT's c_attn [3C, C] (query rows, then key, then value): each head's logits scale
    by its gamma (weights and biases), the value rows keep factor 1."""
    from zeroshard.models import GPTConfig
    from zeroshard.optim.muon.qk_clip import attention_modules

    torch.manual_seed(2)
    from zeroshard.models.gpt import CausalSelfAttention

    attn = CausalSelfAttention(GPTConfig(n_embd=16, n_head=4, block_size=8)).double()
    [(_, _, heads)] = list(attention_modules(attn))
    gamma = torch.tensor([0.3, 1.0, 0.7, 1.0], dtype=torch.float64)
    rows = {"c_attn.weight": 48, "c_attn.bias": 48}
    factors = heads.row_factors(gamma, 0.5, rows)
    x = torch.randn(5, 16, dtype=torch.float64)

    def logits(w, b):
        q, k, _ = (x @ w.T + b).split(16, dim=1)
        return torch.einsum("shd,thd->hst", q.view(5, 4, 4), k.view(5, 4, 4))

    w, b = attn.c_attn.weight.detach(), attn.c_attn.bias.detach()
    after = logits(w * factors["c_attn.weight"].unsqueeze(1), b * factors["c_attn.bias"])
    torch.testing.assert_close(after, logits(w, b) * gamma.view(-1, 1, 1), rtol=1e-12, atol=1e-12)
    assert torch.equal(factors["c_attn.weight"][32:], torch.ones(16, dtype=torch.float64))


def _tiny_hf(family: str):
    import transformers

    common = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=8, attn_implementation="eager",
                  experts_implementation="eager")  # grouped_mm has no float64
    if family == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=2, num_experts_per_tok=1, **common)
        return transformers.MixtralForCausalLM(config)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, **common)
        return transformers.Qwen3MoeForCausalLM(config)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))


@pytest.mark.parametrize("family, kind, query, key", [
    ("mixtral", "gqa", ("q_proj.weight",), ("k_proj.weight",)),
    ("qwen3", "qk_norm", ("q_norm.weight",), ("k_norm.weight",)),
    ("qwen3_moe", "qk_norm", ("q_norm.weight",), ("k_norm.weight",)),
])
def test_presets_name_the_weights_behind_the_logits(family, kind, query, key):
    """Mixtral: GQA projections. Qwen3 and Qwen3-MoE: RMSNorm per head after q_proj/k_proj
    cancels any scale of theirs, so the shared norm weights take the layer's smallest gamma;
    checked on the model's own eager logits (first layer, so its input is unchanged)."""
    pytest.importorskip("transformers")
    import sys

    from zeroshard.optim.muon.qk_clip import attention_modules

    torch.manual_seed(3)
    model = _tiny_hf(family).double().eval()
    [(name, attn, heads)] = list(attention_modules(model))
    assert (name, heads.kind, heads.query, heads.key, heads.num_heads, heads.num_kv_heads) == (
        "model.layers.0.self_attn", kind, query, key, 4, 2)
    model_file = sys.modules[type(attn).__module__]
    original, seen = model_file.eager_attention_forward, []

    def probe(module, q, k, v, mask, *args, **kwargs):
        seen.append(_full_max(q, k, kwargs["scaling"], mask))
        return original(module, q, k, v, mask, *args, **kwargs)

    ids = torch.randint(0, 32, (2, 8))
    model_file.eager_attention_forward = probe
    try:
        with torch.no_grad():
            model(input_ids=ids)
            gamma = torch.tensor([0.5, 1.0, 0.8, 0.9], dtype=torch.float64)
            rows = {n: attn.get_parameter(n).shape[0] for n in heads.query + heads.key}
            for n, factor in heads.row_factors(gamma, 0.5, rows).items():
                p = attn.get_parameter(n)
                p.mul_(factor.view(-1, *([1] * (p.dim() - 1))))
            model(input_ids=ids)
    finally:
        model_file.eager_attention_forward = original
    want = seen[0] * (gamma.min() if kind == "qk_norm" else gamma)
    torch.testing.assert_close(seen[1], want, rtol=1e-10, atol=0)


def _clip_config() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
            "optimizer": {"type": "Muon", "params": {"qk_clip": {"enabled": True}}}}


def test_engine_refuses_qk_clip_without_attention_it_knows():
    import zeroshard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="no attention module QK-clip knows.*register_qk_clip_heads"):
        zeroshard.initialize(model=model, config=_clip_config())


def test_engine_refuses_qk_clip_with_a_user_optimizer():
    import zeroshard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="qk_clip needs the engine's Muon"):
        zeroshard.initialize(model=model, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.1),
                             config=_clip_config())


THRESHOLD = 0.035  # the tiny Llama's logits are 0.03-0.05: some heads clipped at every step


def _llama_engine():
    from transformers import LlamaConfig, LlamaForCausalLM

    import zeroshard

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa"))
    muon = {"lr": 0.02, "qk_clip": {"enabled": True, "threshold": THRESHOLD}}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Muon", "params": muon}}
    engine, *_ = zeroshard.initialize(model=model, config=config, dist_init_required=False)
    return engine


def test_only_training_forwards_feed_the_clip():
    """A forward under torch.no_grad() with the module in train mode (an evaluation that forgot
    eval(), a generation) between backward and step does not change the step's S_max or the
    clipped weights: bitwise the run without it (before: the extra batch's logits raised S_max
    and the clip, and the weights differed)."""
    pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (2, 8), generator=g) for _ in range(2)]
    other = torch.randint(0, 64, (4, 16), generator=g)  # more positions: a larger maximum
    runs = []
    for with_eval in (False, True):
        engine = _llama_engine()
        for step, ids in enumerate(batches):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if with_eval:
                with torch.no_grad():  # train mode still on
                    engine(input_ids=other)
            engine.step()
            if step == 0:
                s_max = engine.qk_clip.last_max.clone()
        runs.append((s_max, {n: p.detach().clone() for n, p in engine.module.named_parameters()}))
    (plain_max, plain), (eval_max, evaluated) = runs
    assert torch.equal(eval_max, plain_max), (eval_max, plain_max)
    assert (plain_max > THRESHOLD).any(), "the threshold should clip something, or the check proves nothing"
    for name, value in plain.items():
        assert torch.equal(evaluated[name], value), name
