"""Rank-side scenarios for tests/dist/sequence/test_autosp.py: AutoSP's ViT wrapper and fusion adapters
against the single-device computation (every rank computes that on the whole sequence too).

Each rank's slice has its own length (the patch or token count is not a multiple of the ranks).
The distributed loss is the sum over ranks of each rank's outputs against the same random
weights; a replicated [CLS] output is counted on rank 0 only. Gradients of replicated inputs
(the CLS token, visual features, parameters) are summed over the ranks here, as ZeRO's
reduction sums sequence ranks' gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.sequence.auto_sp import auto_wrap_model_for_sp
from zeroshard.sequence.autosp_fusion import InternVLFusionAdapter, LlavaFusionAdapter, Qwen2VLFusionAdapter
from zeroshard.sequence.autosp_vit import UlyssesSPViTAttention
from zeroshard.sequence.padding import padded_sequence, shard_sequence, unshard_sequence, valid_positions


def _slices(n: int, world: int) -> list[tuple[int, int]]:
    """Uneven, contiguous: the first ranks take one more."""
    base, extra = divmod(n, world)
    bounds, start = [], 0
    for r in range(world):
        size = base + (r < extra)
        bounds.append((start, start + size))
        start += size
    return bounds


def _summed(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.clone()
    dist.all_reduce(t)
    return t


def _param_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def internvl_attention(patches: int) -> dict[str, Any]:
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionAttention

    torch.manual_seed(0)
    config = InternVLVisionConfig(hidden_size=32, num_attention_heads=4, attn_implementation="sdpa")
    attn = InternVLVisionAttention(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(2, 1 + patches, 32)
    weights = torch.randn(2, 1 + patches, 32)

    ref_in = full.clone().requires_grad_(True)
    ref_out = attn(ref_in)[0]
    (ref_out * weights).sum().backward()
    ref = {"out": ref_out.detach(), "in_grad": ref_in.grad, "params": _param_grads(attn)}
    attn.zero_grad(set_to_none=True)

    a, b = _slices(patches, world)[rank]
    local = torch.cat((full[:, :1], full[:, 1 + a : 1 + b]), 1).requires_grad_(True)
    wrapped = UlyssesSPViTAttention(attn, dist.group.WORLD, has_cls_token=True)
    out = wrapped(local)[0]
    local_weights = torch.cat((weights[:, :1] * (rank == 0), weights[:, 1 + a : 1 + b]), 1)
    (out * local_weights).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(attn).items()}
    return {
        "out_cls": (out[:, 0].detach(), ref["out"][:, 0]),
        "out_patches": (out[:, 1:].detach(), ref["out"][:, 1 + a : 1 + b]),
        "grad_patches": (local.grad[:, 1:], ref["in_grad"][:, 1 + a : 1 + b]),
        "grad_cls": (_summed(local.grad[:, :1]), ref["in_grad"][:, :1]),
        "params": {n: (params[n], ref["params"][n]) for n in ref["params"]},
    }


def qwen2vl_attention(patches: int) -> dict[str, Any]:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(embed_dim=32, num_heads=4, attn_implementation="sdpa")
    attn = VisionAttention(config)
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.randn(patches, 32)
    weights = torch.randn(patches, 32)
    cu_seqlens = torch.tensor([0, 3, patches], dtype=torch.int32)  # two images
    angles = torch.randn(patches, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    ref_in = full.clone().requires_grad_(True)
    ref_out = attn(ref_in, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
    (ref_out * weights).sum().backward()
    ref_params = _param_grads(attn)
    attn.zero_grad(set_to_none=True)

    a, b = _slices(patches, world)[rank]
    local = full[a:b].clone().requires_grad_(True)
    wrapped = UlyssesSPViTAttention(attn, dist.group.WORLD, has_cls_token=False)
    out = wrapped(local, cu_seqlens=cu_seqlens, position_embeddings=(cos[a:b], sin[a:b]))
    (out * weights[a:b]).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(attn).items()}
    return {
        "out": (out.detach(), ref_out.detach()[a:b]),
        "grad": (local.grad, ref_in.grad[a:b]),
        "params": {n: (params[n], ref_params[n]) for n in ref_params},
    }


def _visual_mask_reference(ids: torch.Tensor, kind: str) -> torch.Tensor:
    """Where the visual rows go, computed by a plain loop (independent of the adapters)."""
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for row in range(ids.shape[0]):
        inside = False
        for col in range(ids.shape[1]):
            token = int(ids[row, col])
            if kind == "qwen2vl":
                if token == 7:
                    inside = True
                elif token == 8:
                    inside = False
                else:
                    mask[row, col] = inside
            else:
                mask[row, col] = token == 5
    return mask


def _adapter(kind: str, projection: nn.Module, group: Any) -> nn.Module:
    if kind == "llava":
        return LlavaFusionAdapter(projection, group, image_token_id=5)
    if kind == "internvl":
        return InternVLFusionAdapter(projection, group, image_token_id=5)
    return Qwen2VLFusionAdapter(projection, group, vision_start_token_id=7, vision_end_token_id=8)


def _equal_slice(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of `full` [batch, seq, ...] padded with zeros to a multiple of the
    ranks (written out here, independent of padding.shard_sequence)."""
    chunk = -(-full.shape[1] // world)
    padded = torch.cat((full, full.new_zeros(full.shape[0], chunk * world - full.shape[1], *full.shape[2:])), 1)
    return padded[:, rank * chunk:(rank + 1) * chunk]


def fusion(kind: str) -> dict[str, Any]:
    """DeepSpeed's call: each rank passes its uneven shard of the per-sample visual features
    [batch, tokens, dim_in] and the whole text; sample i's placeholders take the first rows of
    its features (Qwen2-VL's second sample has fewer placeholders than tokens)."""
    torch.manual_seed(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    if kind == "qwen2vl":
        ids = torch.tensor([[1, 7, 6, 6, 6, 8, 2, 7, 6, 8, 3], [7, 6, 6, 8, 1, 1, 2, 3, 7, 6, 8]])
    else:
        ids = torch.tensor([[1, 5, 5, 5, 2, 3, 5, 5, 4, 1, 2], [5, 5, 1, 2, 3, 4, 5, 1, 2, 5, 5]])
    mask = _visual_mask_reference(ids, kind)
    counts = mask.sum(1).tolist()
    projection = nn.Linear(12, 16)
    visual = torch.randn(2, max(counts), 12)
    embeds = torch.randn(2, ids.shape[1], 16)
    weights = torch.randn(2, ids.shape[1], 16)

    ref_visual, ref_embeds = visual.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    projected = projection(ref_visual)
    ref_out = ref_embeds.masked_scatter(mask.unsqueeze(-1), torch.cat([projected[i, :n] for i, n in enumerate(counts)]))
    (ref_out * weights).sum().backward()
    ref_params = _param_grads(projection)
    projection.zero_grad(set_to_none=True)

    a, b = _slices(visual.shape[1], world)[rank]
    local_visual, full_embeds = visual[:, a:b].clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    out = _adapter(kind, projection, dist.group.WORLD)(local_visual, full_embeds, ids)
    (out * _equal_slice(weights, world, rank)).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(projection).items()}
    return {
        "out": (out.detach(), _equal_slice(ref_out.detach(), world, rank)),
        "grad_embeds": (_summed(full_embeds.grad), ref_embeds.grad),
        "grad_visual": (local_visual.grad, ref_visual.grad[:, a:b]),
        "params": {n: (params[n], ref_params[n]) for n in ref_params},
    }


def all_cases() -> dict[str, Any]:
    return {
        "internvl_attention": internvl_attention(7),
        "qwen2vl_attention": qwen2vl_attention(9),
        **{f"fusion_{kind}": fusion(kind) for kind in ("llava", "internvl", "qwen2vl")},
    }


def auto_wrap() -> dict[str, Any]:
    from transformers import LlamaConfig
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionAttention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    model = nn.Module()
    model.vision = nn.ModuleList([InternVLVisionAttention(InternVLVisionConfig(hidden_size=32, num_attention_heads=4)),
                                  VisionAttention(Qwen2VLVisionConfig(embed_dim=32, num_heads=4))])
    model.decoder = LlamaAttention(LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2), 0)
    auto_wrap_model_for_sp(model, dist.group.WORLD)
    first = [type(m).__name__ for m in (model.vision[0], model.vision[1], model.decoder)]
    cls_flags = [model.vision[0].has_cls_token, model.vision[1].has_cls_token]
    auto_wrap_model_for_sp(model, dist.group.WORLD)
    second = [type(m).__name__ for m in (model.vision[0], model.vision[1], model.decoder)]
    inner = [type(model.vision[0].attn).__name__, type(model.vision[1].attn).__name__]
    return {"first": first, "second": second, "cls": cls_flags, "inner": inner}


# Padded: the whole sequence is padded to a multiple of the ranks and cut into equal slices
# (shard_sequence); the wrappers run inside padded_sequence(valid_length). The loss counts real
# positions only (valid_positions); the input gradient is that of the whole unpadded input,
# summed over the ranks (each rank's slice, and the replicated CLS, flow back into it).


def _padded_checks(out, full_in, ref_out, ref_in_grad, mask, dim, first, valid, params, ref_params):
    group = dist.group.WORLD
    body = out.narrow(dim, first, out.shape[dim] - first)
    real = int(mask.sum())
    rank_start = dist.get_rank() * body.shape[dim]
    ref_body = ref_out.narrow(dim, first, ref_out.shape[dim] - first)
    return {
        "out_real": (body.narrow(dim, 0, real).detach(), ref_body.narrow(dim, rank_start, real).detach()),
        "out_padding_zero": (body.narrow(dim, real, body.shape[dim] - real).detach(),
                             torch.zeros_like(body.narrow(dim, real, body.shape[dim] - real))),
        "unsharded": (unshard_sequence(out.detach(), group, valid, dim, has_cls_token=bool(first)), ref_out.detach()),
        "grad_input": (_summed(full_in.grad), ref_in_grad),
        "params": {n: (params[n], ref_params[n]) for n in ref_params},
    }


def internvl_attention_padded(patches: int) -> dict[str, Any]:
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionAttention

    torch.manual_seed(0)
    config = InternVLVisionConfig(hidden_size=32, num_attention_heads=4, attn_implementation="sdpa")
    attn = InternVLVisionAttention(config)
    rank, group = dist.get_rank(), dist.group.WORLD
    full = torch.randn(2, 1 + patches, 32)
    weights = torch.randn(2, 1 + patches, 32)

    ref_in = full.clone().requires_grad_(True)
    ref_out = attn(ref_in)[0]
    (ref_out * weights).sum().backward()
    ref_grad, ref_params = ref_in.grad, _param_grads(attn)
    attn.zero_grad(set_to_none=True)

    full_in = full.clone().requires_grad_(True)
    local = shard_sequence(full_in, group, dim=1, has_cls_token=True)
    with padded_sequence(patches):
        out = UlyssesSPViTAttention(attn, group, has_cls_token=True)(local)[0]
        mask = valid_positions(local.shape[1] - 1, group)
    local_weights = shard_sequence(weights, group, dim=1, has_cls_token=True)
    keep = torch.cat((torch.tensor([rank == 0]), mask)).view(1, -1, 1)  # CLS counted once; no padding
    (out * local_weights * keep).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(attn).items()}
    return _padded_checks(out, full_in, ref_out, ref_grad, mask, 1, 1, patches, params, ref_params)


def qwen2vl_attention_padded(patches: int) -> dict[str, Any]:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import VisionAttention

    torch.manual_seed(0)
    config = Qwen2VLVisionConfig(embed_dim=32, num_heads=4, attn_implementation="sdpa")
    attn = VisionAttention(config)
    group = dist.group.WORLD
    full = torch.randn(patches, 32)
    weights = torch.randn(patches, 32)
    cu_seqlens = torch.tensor([0, 3, patches], dtype=torch.int32)  # two images, real patches only
    angles = torch.randn(patches, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()

    ref_in = full.clone().requires_grad_(True)
    ref_out = attn(ref_in, cu_seqlens=cu_seqlens, position_embeddings=(cos, sin))
    (ref_out * weights).sum().backward()
    ref_grad, ref_params = ref_in.grad, _param_grads(attn)
    attn.zero_grad(set_to_none=True)

    full_in = full.clone().requires_grad_(True)
    local = shard_sequence(full_in, group, dim=0)
    rotary = (shard_sequence(cos, group, dim=0), shard_sequence(sin, group, dim=0))
    with padded_sequence(patches):
        out = UlyssesSPViTAttention(attn, group, has_cls_token=False)(
            local, cu_seqlens=cu_seqlens, position_embeddings=rotary)
        mask = valid_positions(local.shape[0], group)
    (out * shard_sequence(weights, group, dim=0) * mask.view(-1, 1)).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(attn).items()}
    return _padded_checks(out, full_in, ref_out, ref_grad, mask, 0, 0, patches, params, ref_params)


def fusion_padded(kind: str, length: int) -> dict[str, Any]:
    """A whole sequence already padded to a multiple of the ranks, with the placeholder id
    itself, inside padded_sequence(length): the padding must still get no visual feature.
    Visual features as flat rows in placeholder order, each rank an uneven shard."""
    torch.manual_seed(0)
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(length)
    if kind == "qwen2vl":
        ids = torch.randint(1, 4, (2, length), generator=gen)
        ids[:, 1], ids[:, 4] = 7, 8  # visual positions 2..3
        ids[1, 5] = 7  # an image still open at the end: its tokens up to the end are visual
        pad_id = 6
    else:
        ids = torch.where(torch.rand(2, length, generator=gen) < 0.5, 5, 1)
        pad_id = 5
    mask = _visual_mask_reference(ids, kind)
    projection = nn.Linear(12, 16)
    visual = torch.randn(int(mask.sum()), 12)
    chunk = -(-length // world)
    embeds = torch.randn(2, chunk * world, 16)  # the padded positions have text embeddings too
    padded_ids = torch.cat((ids, torch.full((2, chunk * world - length), pad_id)), 1)
    weights = torch.randn(2, length, 16)

    ref_visual, ref_embeds = visual.clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    ref_out = ref_embeds[:, :length].masked_scatter(mask.unsqueeze(-1), projection(ref_visual))
    (ref_out * weights).sum().backward()
    ref_params = _param_grads(projection)
    projection.zero_grad(set_to_none=True)

    a, b = _slices(visual.shape[0], world)[rank]
    local_visual, full_embeds = visual[a:b].clone().requires_grad_(True), embeds.clone().requires_grad_(True)
    with padded_sequence(length):
        out = _adapter(kind, projection, group)(local_visual, full_embeds, padded_ids)
        keep = valid_positions(out.shape[1], group)
    (out * _equal_slice(weights, world, rank) * keep.view(1, -1, 1)).sum().backward()
    params = {n: _summed(g) for n, g in _param_grads(projection).items()}
    real = int(keep.sum())
    start = rank * chunk
    return {
        "out_real": (out[:, :real].detach(), ref_out.detach()[:, start : start + real]),
        "padding_is_text": (out[:, real:].detach(), embeds[:, start + real : start + chunk]),
        "unsharded": (unshard_sequence(out.detach(), group, length, 1), ref_out.detach()),
        "grad_embeds": (_summed(full_embeds.grad), ref_embeds.grad),
        "grad_visual": (local_visual.grad, ref_visual.grad[a:b]),
        "params": {n: (params[n], ref_params[n]) for n in ref_params},
    }


def padded_cases() -> dict[str, Any]:
    """Lengths 7 and 13 (neither divides 2 or 4)."""
    cases: dict[str, Any] = {}
    for n in (7, 13):
        cases[f"internvl_attention_padded_{n}"] = internvl_attention_padded(n)
        cases[f"qwen2vl_attention_padded_{n}"] = qwen2vl_attention_padded(n)
        for kind in ("llava", "internvl", "qwen2vl"):
            cases[f"fusion_{kind}_padded_{n}"] = fusion_padded(kind, n)
    return cases
