"""Rank-side scenarios for tests/dist/sequence/test_autosp_models.py: AutoSP on whole Qwen2-VL,
Qwen2.5-VL and InternVL models (transformers 5.23) built from tiny configs.

On every rank the unsharded model computes the reference: its own image features
(`get_image_features`) put into the text embeddings at the image placeholders. Then
`auto_wrap_model_for_sp` wraps the vision attention and each rank runs the recipe of
docs/sequence-parallel.md on its shard of the image patches, uneven shards included: the vision
tower over the shard (the wrapped attention gathers the patches), then the model's fusion
adapter, which returns this rank's slice of the fused sequence. Returned: this rank's fused slice
and the reference's, the vision (and projector) parameter gradients of a weighted sum of the
fused sequence, summed over the ranks, and the reference's, and which attention modules were
wrapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zeroshard.sequence.auto_sp import auto_wrap_model_for_sp
from zeroshard.sequence.autosp_fusion import InternVLFusionAdapter, Qwen2VLFusionAdapter
from zeroshard.sequence.autosp_vit import UlyssesSPViTAttention
from zeroshard.sequence.gather import gather_sequence

HIDDEN, IMAGE, START, END = 32, 5, 6, 7
TEXT = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64)


def _qwen(kind: str):
    import transformers as T

    text = {**TEXT, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
    vision = dict(depth=2, num_heads=4, patch_size=2, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    ids = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, attn_implementation="sdpa")
    if kind == "qwen2_vl":
        config = T.Qwen2VLConfig(text_config=text, vision_config={**vision, "embed_dim": HIDDEN, "hidden_size": HIDDEN,
                                                                  "mlp_ratio": 2}, **ids)
        return T.Qwen2VLForConditionalGeneration(config)
    config = T.Qwen2_5_VLConfig(text_config=text, vision_config={
        **vision, "hidden_size": HIDDEN, "out_hidden_size": HIDDEN, "intermediate_size": 64,
        "fullatt_block_indexes": [1], "window_size": 8}, **ids)
    return T.Qwen2_5_VLForConditionalGeneration(config)


def _internvl():
    import transformers as T

    config = T.InternVLConfig(text_config={"model_type": "qwen2", **TEXT}, vision_config=dict(
        hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=[16, 16],
        patch_size=[4, 4], attn_implementation="sdpa"), image_token_id=IMAGE, attn_implementation="sdpa")
    return T.InternVLForConditionalGeneration(config)


def _wrapped(model: torch.nn.Module) -> dict[str, list[str]]:
    """Attention module class names, wrapped by AutoSP or not."""
    out: dict[str, list[str]] = {"wrapped": [], "plain": []}
    inner = {id(m.attn) for m in model.modules() if isinstance(m, UlyssesSPViTAttention)}
    for module in model.modules():
        if type(module).__name__.endswith("Attention") and not isinstance(module, UlyssesSPViTAttention):
            out["wrapped" if id(module) in inner else "plain"].append(type(module).__name__)
    return out


def _run(model, kind: str, reference_features, pipeline, ids: torch.Tensor) -> dict[str, Any]:
    """The reference (unsharded) and the sharded pipeline's fused slice and gradients."""
    inner = model.model
    rank, world = dist.get_rank(), dist.get_world_size()
    seq = ids.shape[1]
    per = -(-seq // world)
    weights = torch.randn(1, per * world, HIDDEN, generator=torch.Generator().manual_seed(3))
    embeds = inner.get_input_embeddings()(ids).detach()  # the text side is not sharded: not compared
    reference = embeds.masked_scatter((ids == IMAGE).unsqueeze(-1), reference_features())
    (reference * weights[:, :seq]).sum().backward()
    trained = {n: p for n, p in inner.named_parameters() if p.grad is not None}
    ref_grads = {n: p.grad.clone() for n, p in trained.items()}
    inner.zero_grad(set_to_none=True)
    auto_wrap_model_for_sp(model, dist.group.WORLD)
    mine = pipeline(embeds)
    (mine * weights[:, rank * per : (rank + 1) * per]).sum().backward()
    grads = {}
    for name, p in inner.named_parameters():
        name = name.replace(".attn.attn.", ".attn.").replace(".attention.attn.", ".attention.")
        if name in trained:
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            grads[name] = grad
    padded = torch.cat((reference, reference.new_zeros(1, per * world - seq, HIDDEN)), 1)
    ref_slice = padded[:, rank * per : (rank + 1) * per]
    return {"fused": mine.detach(), "ref_fused": ref_slice.detach(), "grads": grads, "ref_grads": ref_grads,
            "attention": _wrapped(model)}


def qwen_pipeline(kind: str) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL: two images (4x4 and 4x6 patches, 40 rows, 10 merged tokens); rank 0
    takes 24 patch rows, rank 1 16 (multiples of the 2x2 merge unit)."""
    torch.manual_seed(0)
    model = _qwen(kind).float()
    inner, rank = model.model, dist.get_rank()
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    pixels = torch.randn(40, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2, START, *[IMAGE] * 4, END, 3, START, *[IMAGE] * 6, END, 4, 9]])
    lo, hi = [(0, 24), (24, 40)][rank]
    visual = inner.visual
    adapter = Qwen2VLFusionAdapter(None, dist.group.WORLD, START, END)

    def pipeline(embeds: torch.Tensor) -> torch.Tensor:
        if kind == "qwen2_vl":  # the tower runs on the shard as it is
            local = visual(pixels[lo:hi], grid_thw=grid).pooler_output
            return adapter(local, embeds, ids)
        # Qwen2.5-VL orders patches by attention window over the whole image: shard in that order
        # (with the window order's positions), then put the merged tokens back in placeholder order.
        from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

        window, cu_window = get_vision_window_index(grid, spatial_merge_size=visual.spatial_merge_size,
                                                    window_size=visual.window_size, patch_size=visual.patch_size)
        unit = visual.spatial_merge_unit

        def windowed(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(t.shape[0] // unit, unit, -1)[window].reshape(t.shape[0], -1)

        positions = windowed(get_vision_position_ids(grid, visual.spatial_merge_size))
        local = visual(windowed(pixels)[lo:hi], grid_thw=grid, window_index=torch.arange((hi - lo) // unit),
                       cu_window_seqlens=cu_window, position_ids=positions[lo:hi]).pooler_output
        ordered = gather_sequence(local, dist.group.WORLD, 0)[torch.argsort(window)]
        first, last = [(0, 6), (6, 10)][rank]  # any split of the 10 tokens in placeholder order
        return adapter(ordered[first:last], embeds, ids)

    def reference_features() -> torch.Tensor:
        return torch.cat(inner.get_image_features(pixels, grid).pooler_output)

    return _run(model, kind, reference_features, pipeline, ids)


def internvl_pipeline() -> dict[str, Any]:
    """InternVL: two 16x16 images (16 patches and a CLS token each); the encoder layers run on this
    rank's slice of the 17 positions (10 and 7), the pixel shuffle on the gathered grid, and the
    fusion adapter projects this rank's rows of the shuffled features (5 and 3 of 8)."""
    torch.manual_seed(0)
    model = _internvl().float()
    inner, rank = model.model, dist.get_rank()
    config = model.config
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[1, 2, *[IMAGE] * 4, 3, *[IMAGE] * 4, 4, 9]])
    tower = inner.vision_tower
    adapter = InternVLFusionAdapter(inner.multi_modal_projector, dist.group.WORLD, image_token_id=IMAGE)

    def pipeline(embeds: torch.Tensor) -> torch.Tensor:
        positions = tower.embeddings(pixels)  # [2, 17, hidden]: CLS first, in rank 0's slice
        lo, hi = [(0, 10), (10, 17)][rank]
        local = tower.layernorm(tower.encoder(positions[:, lo:hi])[0])
        patches = gather_sequence(local, dist.group.WORLD, 1)[:, 1:].contiguous()  # the shuffle needs the grid
        side = int(patches.shape[1] ** 0.5)
        shuffled = inner.pixel_shuffle(patches.reshape(2, side, side, -1), scale_factor=config.downsample_ratio)
        rows = shuffled.reshape(-1, shuffled.shape[-1])
        first, last = [(0, 5), (5, 8)][rank]
        return adapter(rows[first:last], embeds, ids)

    def reference_features() -> torch.Tensor:
        return inner.get_image_features(pixels, vision_feature_layer=config.vision_feature_layer,
                                        vision_feature_select_strategy=config.vision_feature_select_strategy
                                        ).pooler_output.reshape(-1, HIDDEN)

    return _run(model, "internvl", reference_features, pipeline, ids)


def all_models() -> dict[str, dict[str, Any]]:
    return {"qwen2_vl": qwen_pipeline("qwen2_vl"), "qwen2_5_vl": qwen_pipeline("qwen2_5_vl"),
            "internvl": internvl_pipeline()}
