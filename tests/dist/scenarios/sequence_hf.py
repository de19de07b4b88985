"""Rank-side scenarios for tests/dist/sequence/test_sequence_hf.py (ALST: Hugging Face models under Ulysses).

A tiny Llama is built from a config with the same seed on every rank. The reference is that
model on the whole sequence in this process, computed before Ulysses is registered; then each
rank runs its slice of the sequence through the registered attention.
"""

from __future__ import annotations

import os
import tempfile
import types
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

VOCAB = 128


def tiny_llama(attn: str = "sdpa", heads: int = 4, kv_heads: int = 2, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=16 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=2,
        intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=256, attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _summed_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]


def equality(cases: list[tuple[str, int, int, int]]) -> list[dict[str, Any]]:
    """For (attn, heads, kv_heads, sp): logits of this rank's slice and the parameter gradients
    of the summed token loss (summed over the sequence group), with the reference's."""
    results = []
    for attn, heads, kv_heads, sp in cases:
        model = tiny_llama(attn, heads, kv_heads)
        world, rank = dist.get_world_size(), dist.get_rank()
        batch, seq = 2, 6 * sp
        group_index = rank // sp
        gen = torch.Generator().manual_seed(100 + group_index)  # groups train on different data
        input_ids = torch.randint(0, VOCAB, (batch, seq), generator=gen)
        labels = input_ids.clone()
        labels[0, : seq // 3] = -100  # prompt tokens, not counted
        positions = torch.arange(seq).expand(batch, seq)

        ref_logits = model(input_ids=input_ids, position_ids=positions).logits
        _summed_loss(ref_logits, _shift(labels)).backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, attn, sp, batch)
        try:
            sp_rank = mpu.get_sequence_parallel_rank()
            mine = slice(sp_rank * 6, (sp_rank + 1) * 6)
            logits = model(input_ids=input_ids[:, mine], position_ids=positions[:, mine]).logits
            _summed_loss(logits, _shift(labels)[:, mine]).backward()
            group = mpu.get_sequence_parallel_group()
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
        assert world % sp == 0
        results.append({"logits": logits.detach(), "ref_logits": ref_logits.detach()[:, mine],
                        "grads": grads, "ref_grads": ref_grads})
    return results


def eval_and_paths() -> dict[str, Any]:
    """disable_in_eval: the plain model's output in eval mode on the whole sequence; a local
    config path registers too; after unregistering, sdpa is what it was."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out: dict[str, Any] = {}
    model = tiny_llama("sdpa")
    input_ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
    sdpa_before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, disable_in_eval=True)
    try:
        with torch.no_grad():
            out["eval"] = (model(input_ids=input_ids).logits, plain)
        out["wrapped"] = ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa_before
    finally:
        UlyssesSPAttentionHF.unregister_from_transformers()
    out["restored"] = ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_before

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"rank{dist.get_rank()}")
        model.config.save_pretrained(path)
        mpu = UlyssesSPAttentionHF.register_with_transformers(path, "sdpa", 2, 1)
        try:
            out["path_mpu"] = (mpu.get_sequence_parallel_world_size(), mpu.get_sequence_parallel_rank())
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
    out["size_one"] = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 1, 1)
    return out


def hub_kernel() -> dict[str, Any]:
    """A hub-kernel name goes through transformers' lazy import (stubbed here: nothing can be
    downloaded) and is wrapped under its own name; sdpa is left as it was."""
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers import LlamaConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = "kernels-community/fake-attn"
    loaded = []

    def fake_lazy_import(implementation, *args, **kwargs):
        loaded.append(implementation)
        ALL_ATTENTION_FUNCTIONS[implementation] = lambda *a, **k: None

    real = fa_utils.lazy_import_flash_attention
    fa_utils.lazy_import_flash_attention = fake_lazy_import
    sdpa_before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    try:
        holder = types.SimpleNamespace(config=LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))
        UlyssesSPAttentionHF.register_with_transformers(holder, name, 2, 1)
        result = {"loaded": loaded, "sdpa_untouched": ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_before,
                  "wrapped": getattr(ALL_ATTENTION_FUNCTIONS[name], "__name__", "")}
        UlyssesSPAttentionHF.unregister_from_transformers()
    finally:
        fa_utils.lazy_import_flash_attention = real
    return result


def refusals() -> list[str]:
    messages = []
    for call in (
        lambda: UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa"), "eager", 2, 1),
        lambda: UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa", heads=1, kv_heads=1), "sdpa", 2, 1),
        lambda: UlyssesSPAttentionHF.register_with_transformers(tiny_llama("sdpa"), "sdpa", 2, 1, seq_length=7,
                                                                seq_length_is_variable=False),
    ):
        try:
            call()
            messages.append("no error")
            UlyssesSPAttentionHF.unregister_from_transformers()
        except ValueError as error:
            messages.append(str(error))
    return messages


class _Loader:
    """Rank r's own data loader: two batches whose tokens say which rank and batch they are."""

    def __init__(self, rank: int, seq: int) -> None:
        self.batches = []
        for b in range(2):
            ids = 1000 * rank + 100 * b + torch.arange(2 * seq).view(2, seq)
            self.batches.append({"input_ids": ids, "labels": ids + 10_000, "tag": f"rank{rank}-batch{b}"})

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def adapter(seq: int) -> list[dict[str, Any]]:
    """Everything this rank's adapter yields for one epoch over two-batch loaders."""
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    dl = UlyssesSPDataLoaderAdapter(_Loader(rank, seq), rank, group, world, torch.device("cpu"))
    out = [dict(b) for b in dl]
    again = [dict(b) for b in dl]  # a second epoch starts over
    return [out, again, len(dl)]


class _OneBatch:
    def __init__(self, batch: dict[str, torch.Tensor]) -> None:
        self.batch = batch

    def __iter__(self):
        return iter([self.batch])

    def __len__(self) -> int:
        return 1


def padded_alst(cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """(attn, seq) with seq not divisible by the world: every rank's loader yields its own batch;
    the adapter pads to a multiple of P. For each of the P micro-batches, this rank's logits on
    its real positions, the token-weighted loss and the group-summed gradients, with the model's
    on the unpadded batch (mean token loss)."""
    from zeroshard.sequence.loss import token_weighted_loss

    results = []
    rank, world = dist.get_rank(), dist.get_world_size()
    for attn, seq in cases:
        model = tiny_llama(attn)
        sources = []
        for r in range(world):
            gen = torch.Generator().manual_seed(1000 * seq + r)
            ids = torch.randint(1, VOCAB, (2, seq), generator=gen)
            labels = ids.clone()
            labels[1, :3] = -100  # prompt tokens, not counted
            sources.append({"input_ids": ids, "labels": labels})
        refs = []
        for source in sources:
            logits = model(input_ids=source["input_ids"]).logits
            shifted = _shift(source["labels"])
            (_summed_loss(logits, shifted) / (shifted != -100).sum()).backward()
            refs.append((logits.detach(), _summed_loss(logits, shifted).detach() / (shifted != -100).sum(),
                         {n: p.grad.clone() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)

        mpu = UlyssesSPAttentionHF.register_with_transformers(model, attn, world, 2)
        try:
            group = mpu.get_sequence_parallel_group()
            loader = UlyssesSPDataLoaderAdapter(_OneBatch(sources[rank]), rank, group, world, torch.device("cpu"))
            for micro, (ref_logits, ref_loss, ref_grads) in zip(loader, refs, strict=True):
                shift_labels = micro.pop("shift_labels")
                logits = model(**micro).logits
                loss_sum = _summed_loss(logits, shift_labels)
                loss = token_weighted_loss(loss_sum, (shift_labels != -100).sum(), group)
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=group)
                local = logits.shape[1]
                real = max(0, min(local, seq - rank * local))
                results.append({
                    "logits": (logits.detach()[:, :real], ref_logits[:, rank * local : rank * local + real]),
                    "loss": (loss.detach(), ref_loss),
                    "grads": {n: (p.grad.clone(), ref_grads[n]) for n, p in model.named_parameters()},
                })
                model.zero_grad(set_to_none=True)
        finally:
            UlyssesSPAttentionHF.unregister_from_transformers()
    return results


def attention_level(cases: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """For (heads, kv_heads) on 2 ranks: UlyssesSPAttentionHF around transformers' sdpa attention
    on this rank's slice, against the same attention on the whole sequence (outputs [batch, seq,
    heads, dim] and the query, key and value gradients, this rank's positions), and the heads each
    rank attended over."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    results = []
    for heads, kv_heads in cases:
        batch, seq, dim = 2, 4 * world, 8
        gen = torch.Generator().manual_seed(7 * heads + kv_heads)
        q = torch.randn(batch, heads, seq, dim, generator=gen)
        k, v = (torch.randn(batch, kv_heads, seq, dim, generator=gen) for _ in range(2))
        grad_out = torch.randn(batch, seq, heads, dim, generator=gen)
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal, module.layer_idx = heads // kv_heads, True, 0
        ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref_out, _ = sdpa_attention_forward(module, *ref_in, None)
        ref_out.backward(grad_out)
        seen: list[int] = []

        def core(mod, q_, k_, v_, mask, *args, seen=seen, **kwargs):
            seen.append(q_.shape[1])
            return sdpa_attention_forward(mod, q_, k_, v_, mask, *args, **kwargs)

        ulysses = UlyssesSPAttentionHF(core, batch, heads, dim, kv_heads, 1, group, seq_length_is_variable=True)
        mine = slice(rank * 4, (rank + 1) * 4)
        local = [t[:, :, mine].clone().requires_grad_(True) for t in (q, k, v)]
        out, _ = ulysses(module, *local, None)
        out.backward(grad_out[:, mine])
        results.append({"out": out.detach(), "ref_out": ref_out.detach()[:, mine], "heads_here": seen[0],
                        "grads": [t.grad for t in local], "ref_grads": [t.grad[:, :, mine] for t in ref_in]})
    return results
