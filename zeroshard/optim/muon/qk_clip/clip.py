"""QKClip: the step-side half of MuonClip. After each optimizer step: every module's S_max,
one MAX all-reduce over the world, gamma = min(1, tau / S_max) per head, and the query/key
rows of the master weights rescaled where this rank holds them (see qk_clip/__init__.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import collectives as comm
from zeroshard.optim.muon.qk_clip.capture import RECORDER_ATTR, install_capture
from zeroshard.optim.muon.qk_clip.heads import QKHeads, attention_modules
from zeroshard.optim.muon.qk_clip.settings import QKClipSettings
from zeroshard.sharding.ranges import overlap

if TYPE_CHECKING:
    from zeroshard.comm.collectives import Group
    from zeroshard.sharding.flat import FlatParamGroup


@dataclass(frozen=True)
class _Target:
    """One query or key parameter: where its elements are, and which rows it has."""

    flat: FlatParamGroup
    offset: int  # first element in the full flat buffer
    numel: int
    rows: int
    module_index: int
    pname: str


class QKClip:
    """Rescales query and key master weights after each step (a collective: every rank calls
    `apply` together, as ShardedMuon.step does).

    Args:
        model: the engine's module (attention modules found by `attention_modules`).
        settings: threshold and alpha.
        flats: the engine's flat buffers (each query/key parameter must be in one).
        world: the ranks whose S_max are MAX-reduced (every rank that sees a different part
            of the batch or sequence: the layout's world).
        device: where the forwards ran (the reduction's device; masters may be on the host).
    """

    def __init__(self, model: nn.Module, settings: QKClipSettings, flats: Sequence[FlatParamGroup],
                 world: Group, device: torch.device) -> None:
        self.settings = settings
        self.world = world
        found = list(attention_modules(model))
        if not found:
            raise ValueError(
                "optimizer.params.qk_clip is enabled but the model has no attention module QK-clip knows "
                "(presets: Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3). Register custom "
                "attention with zeroshard.optim.muon.qk_clip.register_qk_clip_heads(module, ...)."
            )
        self.names = [name for name, _, _ in found]
        self.modules = [m for _, m, _ in found]
        self.heads: list[QKHeads] = [h for _, _, h in found]
        install_capture(self.modules, [h.num_heads for h in self.heads])
        where = {}
        for flat in flats:
            for index, p in enumerate(flat.params):
                where[id(p)] = (flat, index)
        self.targets: list[_Target] = []
        for m_index, (name, module, heads) in enumerate(found):
            for pname in dict.fromkeys(heads.query + heads.key):  # a fused weight once
                p = module.get_parameter(pname)
                if id(p) not in where:
                    raise ValueError(
                        f"QK-clip: {name}.{pname} is not trained by the engine (frozen?). QK-clip rescales "
                        "the query and key weights; train them, or turn qk_clip off."
                    )
                flat, index = where[id(p)]
                shape = flat.shapes[index]
                self.targets.append(_Target(flat, flat.offsets[index], flat.numels[index], shape[0], m_index, pname))
        self.device = device
        self.last_max: torch.Tensor | None = None  # every head's S_max of the last step (tests, monitors)

    def take_max(self, device: torch.device) -> torch.Tensor:
        """Every module's per-head S_max since the last call, MAX-reduced over the world
        (one collective), concatenated in module order."""
        local = torch.cat([getattr(m, RECORDER_ATTR).take(device) for m in self.modules])
        comm.all_reduce(local, group=self.world, op=dist.ReduceOp.MAX, tag="qk_clip")
        return local

    @torch.no_grad()
    def apply(self) -> None:
        """Reduce S_max and rescale the masters of every head over the threshold.

        No host read: heads under the threshold get factors of exactly 1.0 (x * 1.0 == x),
        so every query and key row is multiplied every step rather than asking the device
        which heads went over."""
        s_max = self.take_max(self.device)
        self.last_max = s_max
        tau, alpha = self.settings.threshold, self.settings.alpha
        # gamma = tau / S_max where S_max > tau, else exactly 1 (the head is not touched).
        gamma = torch.where(s_max > tau, tau / s_max.clamp(min=tau), torch.ones_like(s_max))
        rows: list[dict[str, int]] = [{} for _ in self.heads]
        for t in self.targets:
            rows[t.module_index][t.pname] = t.rows
        scales: list[dict[str, torch.Tensor]] = []
        start = 0
        for index, heads in enumerate(self.heads):
            scales.append(heads.row_factors(gamma[start : start + heads.num_heads], alpha, rows[index]))
            start += heads.num_heads
        for t in self.targets:
            self._scale_master(t, scales[t.module_index][t.pname])

    @staticmethod
    def _scale_master(t: _Target, row_scale: torch.Tensor) -> None:
        flat = t.flat
        master_start, master_numel = flat.master_range()
        common = overlap(t.offset, t.offset + t.numel, master_start, master_start + master_numel)
        if common is None:
            return
        lo, hi = common
        part = flat.master.narrow(0, lo - master_start, hi - lo)
        cols = t.numel // t.rows
        rows = torch.arange(lo - t.offset, hi - t.offset, device=row_scale.device) // cols
        factor = row_scale[rows].to(part.device)
        part.copy_((part.double() * factor).to(part.dtype))
