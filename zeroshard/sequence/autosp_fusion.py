"""AutoSP fusion adapters: splice visual tokens into the text sequence and hand each rank its
slice of the fused sequence (DeepSpeed's `deepspeed.sequence.autosp_fusion`, same call).

`adapter(local_visual, text_embeds, input_ids)`, as DeepSpeed calls it:
- `local_visual`: this rank's shard of the visual features, before the projection: DeepSpeed's
  per-sample form `[batch, local_tokens, dim_in]` (sample i fills its placeholders, in order,
  with the first rows of its gathered features) or flat rows `[local_rows, dim_in]` in
  placeholder order (row-major over batch and sequence, as `masked_scatter` fills them on one
  device). Shards may have any lengths (P need not divide the visual token count).
- `text_embeds` `[batch, seq, dim]` and `input_ids` `[batch, seq]`: the whole sequence.
Returns this rank's equal slice `[batch, ceil(seq / P), dim]` of the fused sequence, padded at
the end with zeros to a multiple of P (`padding.shard_sequence`'s layout). Placeholders are
replaced one for one (transformers' processors expand each image to one placeholder per
visual token); a count that does not fit is refused.

The projection runs on this rank's shard only; the gather is differentiable (each rank's
shard gets the gradient of every rank's slice), so each rank's projection gradient covers its
own visual rows and the sum over sequence ranks (ZeRO's reduction) is the single-device
gradient. Inside `padding.padded_sequence(valid_length)` (a whole sequence already padded, even
with a placeholder id) no visual feature goes to a padded position: padded rows keep their text
embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import collectives as comm
from zeroshard.sequence.gather import gather_sequence
from zeroshard.sequence.padding import current_valid_length, shard_sequence

__all__ = ["LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter"]


class _FusionAdapter(nn.Module):
    def __init__(self, projection: nn.Module | None, process_group: Any) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group

    def visual_positions(self, input_ids: Tensor) -> Tensor:
        """[batch, seq] bool: where visual features go."""
        raise NotImplementedError

    def forward(self, visual_features: Tensor, text_embeds: Tensor, input_ids: Tensor) -> Tensor:
        group = comm.as_group(self.process_group)
        if tuple(text_embeds.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(
                f"{type(self).__name__}: text_embeds {list(text_embeds.shape)} and input_ids {list(input_ids.shape)} "
                "differ in batch or sequence. Pass the whole sequence's embeddings and ids (the adapter returns "
                "this rank's slice)."
            )
        local = self.projection(visual_features) if self.projection is not None else visual_features
        per_sample = local.dim() >= 3
        features = gather_sequence(local, group, 1 if per_sample else 0).to(text_embeds.dtype)
        with torch.no_grad():
            mask = self.visual_positions(input_ids)
            valid = current_valid_length()
            if valid is not None:
                mask[:, valid:] = False
        rows = _rows(features, mask, per_sample, type(self).__name__)
        fused = text_embeds.masked_scatter(mask.unsqueeze(-1), rows)
        return shard_sequence(fused, group, dim=1)


def _rows(features: Tensor, mask: Tensor, per_sample: bool, who: str) -> Tensor:
    """The gathered features as the rows `masked_scatter` puts at `mask`, in its order."""
    if not per_sample:
        rows, expected = features.reshape(-1, features.shape[-1]), int(mask.sum())
        if rows.shape[0] != expected:
            raise ValueError(
                f"{who}: {rows.shape[0]} visual feature rows for {expected} visual positions in input_ids. Pass "
                "every image's features (this rank's shard of them), in the order their placeholders appear."
            )
        return rows
    counts = mask.sum(1).tolist()
    if features.shape[0] != mask.shape[0] or max(counts, default=0) > features.shape[1]:
        raise ValueError(
            f"{who}: visual features {list(features.shape)} (gathered) for samples with {counts} visual positions. "
            "Each sample needs at least as many visual tokens as its placeholders, one placeholder per token."
        )
    return torch.cat([features[i, :n] for i, n in enumerate(counts)]).reshape(-1, features.shape[-1])


class LlavaFusionAdapter(_FusionAdapter):
    """LLaVA: every `image_token_id` placeholder takes one projected feature row."""

    def __init__(self, projection: nn.Module | None, process_group: Any, image_token_id: int) -> None:
        super().__init__(projection, process_group)
        self.image_token_id = image_token_id

    def visual_positions(self, input_ids: Tensor) -> Tensor:
        return input_ids == self.image_token_id


class InternVLFusionAdapter(LlavaFusionAdapter):
    """InternVL: every image-context placeholder (`image_token_id`, `<IMG_CONTEXT>`) takes one
    row of the projector's (pixel-shuffled, MLP-projected) output."""


class Qwen2VLFusionAdapter(_FusionAdapter):
    """Qwen2-VL: the tokens strictly between a `vision_start_token_id` and the next
    `vision_end_token_id` are the visual positions (the markers stay text)."""

    def __init__(
        self, projection: nn.Module | None, process_group: Any, vision_start_token_id: int, vision_end_token_id: int
    ) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def visual_positions(self, input_ids: Tensor) -> Tensor:
        starts = input_ids == self.vision_start_token_id
        ends = input_ids == self.vision_end_token_id
        inside = (starts.long().cumsum(1) - ends.long().cumsum(1)) > 0
        return inside & ~starts
