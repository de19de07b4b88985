"""Muon: orthogonalized momentum for hidden weight matrices, AdamW for everything else.

[Note: Muon in zeroshard]
One optimizer step, with g the reduced, unscaled, clipped gradient (the engine clips with
the global norm before calling `step`, on every stage):

    Muon parameters   m <- beta m + (1 - beta) g                 (m starts at zero)
                      u <- (1 - beta) g + beta m                 (Nesterov; u <- m without)
                      O <- NS(u) * sqrt(max(1, rows / cols))     (newton_schulz.py)
                      p <- p (1 - lr wd) - lr O
    AdamW parameters  torch's AdamW with bias correction.

Which parameters use Muon is decided on full (unsharded) shapes and names, before any flat
buffer exists (`classify_parameter`): 2-D or more, not an `nn.Embedding` weight (tied ones
included), a name that contains none of `muon_exclude_patterns` ("embed", "lm_head") and
has none of `muon_exclude_modules` ("gate", "router": MoE routers) as a dotted component. A
parameter's own `use_muon` attribute (DeepSpeed's tag) overrides the name and embedding rules.
How a parameter is cut into Newton-Schulz matrices is blocks.py's [Note: Muon blocks]: a
3-D parameter marked `is_expert_group` is a stack of expert matrices [E, rows, cols] (AutoEP's
`experts.w1/w2/w3`, Hugging Face's `*Experts` stacks), each orthogonalized on its own (with its
own norm), batched over the expert dimension; any other N-D weight (conv) is viewed as
(out, rest); attention projections with head attributes are orthogonalized per head
(heads.py sets them on Hugging Face models under `per_head_muon`). Files: settings.py
(config keys), groups.py (classification and the group split), blocks.py and heads.py (the
Newton-Schulz blocks and their presets), maths.py (shared per-tensor maths), sharded.py
(ShardedMuon).
The engine puts the two kinds into separate optimizer groups (`split_param_groups`), so
each flat buffer, and hence each master tensor, holds one kind only: Muon masters keep one
state tensor ("momentum_buffer"), AdamW masters two ("exp_avg", "exp_avg_sq") plus "step",
all laid out like the master (full at stage 0, the shard at stages 1-3), so checkpoints
save, load and reshard them like any state.

Only NS needs whole matrices. Each matrix of a flat has an owner rank (balanced by NS work,
the same on every rank). A step on a Muon master: update m and u on this rank's range;
all-gather u when the master is a shard (stages 1-3); each owner orthogonalizes its
matrices (same-shape ones batched) into a packed buffer; one all-gather of the packed
buffers gives every rank every O; each rank applies O to its own range. With one rank the
same code runs without communication. Newton-Schulz always sees the full, fully reduced
matrix, so every stage computes the same update and all ranks apply identical values.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from zeroshard.monitor.timers import timed
from zeroshard.optim.muon.blocks import BlockLayout, matrix_layout, param_block_layout
from zeroshard.optim.muon.groups import (
    MuonChoice,
    classify_named_parameter,
    classify_parameter,
    embedding_param_ids,
    muon_param_plan,
    split_param_groups,
)
from zeroshard.optim.muon.heads import prepare_muon_marks
from zeroshard.optim.muon.maths import (
    adamw_group_step,
    apply_update,
    compute_dtype_of,
    fill_group_defaults,
    momentum_direction,
)
from zeroshard.optim.muon.newton_schulz import DEFAULT_NS_STEPS, CompilableNewtonSchulz, update_scale
from zeroshard.optim.muon.settings import (
    ADAM_LR,
    CONFIG_KEYS,
    DEFAULT_EXCLUDE_MODULES,
    DEFAULT_EXCLUDE_PATTERNS,
    MUON_LR,
    MuonSettings,
    muon_param_problems,
    parse_muon_params,
)
from zeroshard.optim.muon.sharded import ShardedMuon, assign_owners, build_muon

__all__ = [
    "ADAM_LR",
    "CONFIG_KEYS",
    "DEFAULT_EXCLUDE_MODULES",
    "DEFAULT_EXCLUDE_PATTERNS",
    "MUON_LR",
    "Muon",
    "MuonChoice",
    "MuonSettings",
    "ShardedMuon",
    "assign_owners",
    "build_muon",
    "classify_named_parameter",
    "classify_parameter",
    "is_muon_requested",
    "matrix_layout",
    "muon_param_plan",
    "muon_param_problems",
    "parse_muon_params",
    "split_param_groups",
]


def is_muon_requested(optimizer: Any, optimizer_config: Any) -> bool:
    """Whether the engine must build Muon: a `zeroshard.optim.Muon` instance was passed, or
    none was and the config's optimizer type is Muon."""
    if isinstance(optimizer, Muon):
        return True
    return optimizer is None and optimizer_config is not None and optimizer_config.type.lower() == "muon"


class Muon(CompilableNewtonSchulz, torch.optim.Optimizer):
    """Muon for hidden matrices and AdamW for the rest, in one optimizer (one process).

    Pass it to `zeroshard.initialize(optimizer=...)` and the engine runs the same update
    sharded (its groups and hyper-parameters carry over).

    Args:
        params: a module, its `named_parameters()`, or a list of groups (dicts with
            "params" and "use_muon"; other keys override the defaults for that group).
            Plain parameters without names are refused: the embedding and output head
            could not be told apart from hidden matrices.
        Other arguments: as the config keys of `parse_muon_params`.

    Example:
        opt = Muon(model, lr=0.02, adam_lr=3e-4, weight_decay=0.01)
    """

    def __init__(
        self,
        params: nn.Module | Iterable[tuple[str, nn.Parameter]] | Iterable[dict[str, Any]],
        lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_method: str = "gram",
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        nesterov: bool = True,
        ns_steps: int = DEFAULT_NS_STEPS,
        ns_dtype: str = "auto",
        muon_exclude_patterns: Sequence[str] = DEFAULT_EXCLUDE_PATTERNS,
        muon_exclude_modules: Sequence[str] = DEFAULT_EXCLUDE_MODULES,
        per_head_muon: bool = False,
        per_head_muon_output: bool = False,
    ) -> None:
        cfg: dict[str, Any] = {
            "momentum": momentum, "weight_decay": weight_decay, "ns_method": ns_method,
            "betas": tuple(betas), "eps": eps, "nesterov": nesterov, "ns_steps": ns_steps,
            "ns_dtype": ns_dtype, "muon_exclude_patterns": tuple(muon_exclude_patterns),
            "muon_exclude_modules": tuple(muon_exclude_modules),
            "per_head_muon": per_head_muon, "per_head_muon_output": per_head_muon_output,
        }
        for key, value in (("lr", lr), ("muon_lr", muon_lr), ("adam_lr", adam_lr)):
            if value is not None:
                cfg[key] = value
        settings = parse_muon_params(cfg)
        self.choices: list[MuonChoice] = []  # what was decided for named parameters
        self._names: dict[int, str] = {}  # for errors about a parameter's block marks
        groups = self._groups(params, settings)
        for group in groups:
            fill_group_defaults(group)
        super().__init__(groups, {})

    def _groups(self, params: Any, settings: MuonSettings) -> list[dict[str, Any]]:
        embeddings: set[int] = set()
        if isinstance(params, nn.Module):
            prepare_muon_marks(params, settings.per_head_muon, settings.per_head_muon_output)
            embeddings = embedding_param_ids(params)
            params = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
        elif settings.per_head_muon:
            raise ValueError(
                "Muon(per_head_muon=True) reads the attention heads from the model's config: pass the model "
                "itself, or set the head attributes (p.muon_num_heads, p.muon_head_axis) on its parameters."
            )
        items = list(params)
        if items and all(isinstance(item, dict) for item in items):
            groups = []
            for index, item in enumerate(items):
                if "use_muon" not in item:
                    raise ValueError(
                        f"Muon: param group {index} has no 'use_muon'. Say which kind each group is, "
                        "or pass model.named_parameters() and let Muon decide."
                    )
                groups.append({**settings.group_defaults(bool(item["use_muon"])), **item})
            return groups
        if not all(isinstance(item, tuple) and len(item) == 2 for item in items):
            raise ValueError(
                "Muon: pass the model, model.named_parameters(), or groups with 'use_muon'. Plain "
                "parameters carry no names, so the embedding and output head would get Muon."
            )
        self.choices = [
            classify_named_parameter(n, p, settings, embeddings) for n, p in items
        ]
        self._names = {id(p): n for n, p in items}
        groups = []
        for use_muon in (True, False):
            chosen = [p for (_, p), c in zip(items, self.choices, strict=True) if c.use_muon == use_muon]
            if chosen:
                groups.append({**settings.group_defaults(use_muon), "params": chosen})
        return groups

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not group["use_muon"]:
                adamw_group_step(params, [self.state[p] for p in params], group)
                continue
            # Blocks of one shape are orthogonalized in one batched call ([Note: Muon blocks]).
            by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, BlockLayout, torch.Tensor]]] = {}
            for p in params:
                if p.dim() < 2:
                    raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} is in a use_muon group.")
                u = momentum_direction(p.grad, self.state[p], group)
                layout = param_block_layout(self._names.get(id(p), "parameter"), p)
                by_shape.setdefault((layout.rows, layout.cols), []).append((p, layout, layout.to_blocks(u)))
            for (rows, cols), triples in by_shape.items():
                batch = torch.cat([blocks for _, _, blocks in triples])
                with timed("newton_schulz"):  # a Muon figure (zeroshard/monitor/timers.py)
                    result = self.orthogonalize(batch, group["ns_steps"], group["ns_method"],
                                           compute_dtype_of(group, batch))
                scale = update_scale(rows, cols)
                for (p, layout, blocks), o in zip(triples, result.split([b.shape[0] for _, _, b in triples]),
                                                  strict=True):
                    o = o.to(blocks.dtype)
                    if scale != 1.0:
                        o = o * scale
                    apply_update(p, layout.from_blocks(o).reshape(p.shape), group)
        return loss
