"""AutoSP fusion adapters: splice visual tokens into the sharded text sequence.

A multimodal model puts the projected visual features where its prompt holds image
placeholder tokens. With sequence parallelism each rank holds only a slice of the text, so it
must know which visual features fall in its slice: the adapters gather the (small) token ids
of the whole sequence, number the visual positions in the model's own order (row-major over
batch and sequence, as `masked_scatter` fills them on one device), and fill this rank's
positions with those rows. The projection runs on every rank over all features; each rank's
gradient covers its own rows, so the sum over sequence ranks (ZeRO's reduction) is the
single-device gradient.

`forward(visual_features, text_embeds, input_ids)`: visual features `[..., dim_in]` (all of
them, rows in placeholder order), this rank's `text_embeds` `[batch, local, dim]` and
`input_ids` `[batch, local]`; returns the fused `[batch, local, dim]`. Slices may have any
lengths; equal slices of a padded sequence (`padding.shard_sequence`) work inside
`padding.padded_sequence(valid_length)`: no visual feature goes to a padded position (even
when the padding id is a placeholder id), and padded rows keep their text embedding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from zeroshard.comm import collectives as comm
from zeroshard.sequence.gather import _slice_lengths, gather_sequence
from zeroshard.sequence.padding import current_valid_length

__all__ = ["LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter"]


class _FusionAdapter(nn.Module):
    def __init__(self, projection: nn.Module | None, process_group: Any) -> None:
        super().__init__()
        self.projection = projection
        self.process_group = process_group

    def visual_positions(self, input_ids: Tensor) -> Tensor:
        """[batch, seq] bool: where visual features go, for the whole sequence."""
        raise NotImplementedError

    def forward(self, visual_features: Tensor, text_embeds: Tensor, input_ids: Tensor) -> Tensor:
        group = comm.as_group(self.process_group)
        with torch.no_grad():
            full_ids = gather_sequence(input_ids, group, 1)
            full_mask = self.visual_positions(full_ids)
            valid = current_valid_length()
            if valid is not None:
                full_mask[:, valid:] = False
            order = full_mask.flatten().cumsum(0).view_as(full_mask) - 1  # row of each visual position
            start = sum(_slice_lengths(input_ids.shape[1], group, input_ids.device)[: group.rank])
            mine = slice(start, start + input_ids.shape[1])
            local_mask, local_rows = full_mask[:, mine], order[:, mine][full_mask[:, mine]]
        features = self.projection(visual_features) if self.projection is not None else visual_features
        features = features.reshape(-1, features.shape[-1]).to(text_embeds.dtype)
        expected = int(full_mask.sum())
        if features.shape[0] != expected:
            raise ValueError(
                f"{features.shape[0]} visual feature rows for {expected} visual positions in input_ids. "
                "Pass every image's features, in the order their placeholders appear."
            )
        return text_embeds.masked_scatter(local_mask.unsqueeze(-1), features[local_rows])


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
