"""Engine set-up of MuonClip: when the config's Muon params enable qk_clip, find the attention
modules, install the logit capture and hand ShardedMuon the QKClip it runs after each step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.optim.muon.qk_clip.clip import QKClip
from zeroshard.optim.muon.qk_clip.settings import parse_qk_clip

if TYPE_CHECKING:
    from zeroshard.config.schema import ZeroshardConfig
    from zeroshard.sharding.flat import FlatParamGroup
    from zeroshard.sharding.layout import ParallelLayout


def attach_qk_clip(
    model: nn.Module, config: ZeroshardConfig, flats: Sequence[FlatParamGroup], layout: ParallelLayout,
    optimizer: Any, device: torch.device,
) -> QKClip | None:
    """The engine's QKClip (None unless `optimizer.params.qk_clip.enabled`), attached to the
    optimizer as `optimizer.qk_clip`."""
    section = config.optimizer
    if section is None or section.type.lower() != "muon":
        return None
    settings = parse_qk_clip(dict(section.params or {}).get("qk_clip"))
    if not settings.enabled:
        return None
    from zeroshard.optim.muon.sharded import ShardedMuon

    if not isinstance(optimizer, ShardedMuon):
        raise ValueError(
            "optimizer.params.qk_clip needs the engine's Muon (built from the config's optimizer section); "
            "an optimizer passed to initialize() does not run it. Drop optimizer= or turn qk_clip off."
        )
    if layout.sequence is not None and layout.sequence.size > 1:
        raise ValueError(
            "optimizer.params.qk_clip with sequence parallelism is not supported yet: Ulysses attention "
            "sees a subset of the heads, so per-head S_max would be misattributed. Turn qk_clip off or "
            "train without sequence_parallel_size."
        )
    clip = QKClip(model, settings, flats, layout.world, device)
    optimizer.qk_clip = clip
    return clip
