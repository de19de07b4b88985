"""Which parameters Muon updates (decided on full shapes and names) and the engine's split of
each optimizer group into a Muon part and an AdamW part (see [Note: Muon in zeroshard] in optimizer.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zeroshard.optim.muon.blocks import BlockLayout, block_layout, param_block_layout
from zeroshard.optim.muon.heads import prepare_muon_marks
from zeroshard.optim.muon.settings import (
    ADAM_KEYS,
    DEFAULT_EXCLUDE_MODULES,
    DEFAULT_EXCLUDE_PATTERNS,
    MUON_KEYS,
    MuonSettings,
    parse_muon_params,
)


@dataclass(frozen=True)
class MuonChoice:
    """Which optimizer one parameter gets, and why (for `explain`)."""

    name: str
    shape: tuple[int, ...]
    use_muon: bool
    reason: str
    layout: BlockLayout | None = None  # the blocks Newton-Schulz sees (Muon parameters only)


def full_shape(p: torch.Tensor) -> torch.Size:
    """The parameter's full shape, also while it is empty (built under zero.Init, or freed at stage 3)."""
    return torch.Size(getattr(p, "ds_shape", p.shape)) if p.numel() == 0 else p.shape


def classify_parameter(
    name: str, shape: Sequence[int], exclude_patterns: Sequence[str] = DEFAULT_EXCLUDE_PATTERNS,
    is_embedding: bool = False, exclude_modules: Sequence[str] = DEFAULT_EXCLUDE_MODULES,
    forced: bool | None = None, layout: BlockLayout | None = None,
) -> MuonChoice:
    """Muon or AdamW for one parameter, decided on its full shape and name.

    In order: fewer than 2 dimensions or no elements: AdamW; `forced` (the parameter's own
    `use_muon` attribute, DeepSpeed's tag) decides next; then an `nn.Embedding` weight, a
    name containing one of `exclude_patterns`, or a name with one of `exclude_modules` as a
    whole dotted component (MoE routers: `...gate.wg.weight`, `mlp.gate.weight`,
    `router.weight`) get AdamW; every other matrix gets Muon, cut into `layout`'s blocks
    (default: the unmarked layout of blocks.py, so a 3-D weight is one matrix).

    Raises:
        ValueError: `forced` is True for a parameter that is not a matrix.
    """
    shape = tuple(shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        if forced:
            raise ValueError(
                f"parameter {name!r} (shape {shape}) has use_muon=True, but Muon updates whole matrices. "
                "Set its use_muon attribute to False, or delete it."
            )
        return MuonChoice(name, shape, False, f"{len(shape)}-D" if len(shape) < 2 else "empty")
    if forced is False:
        return MuonChoice(name, shape, False, "use_muon=False on the parameter")
    if not forced:
        if is_embedding:
            return MuonChoice(name, shape, False, "nn.Embedding weight")
        for pattern in exclude_patterns:
            if pattern in name:
                return MuonChoice(name, shape, False, f"name contains {pattern!r}")
        components = name.split(".")
        for module in exclude_modules:
            if module in components:
                return MuonChoice(name, shape, False, f"router: name component {module!r}")
    if layout is None:
        layout = block_layout(shape, name=name)
    reason = layout.describe()
    if layout.kind == "conv":
        reason = f"{len(shape)}-D, {reason}"
    if forced:
        reason += ", use_muon=True on the parameter"
    return MuonChoice(name, shape, True, reason, layout)


def classify_named_parameter(name: str, p: nn.Parameter, settings: MuonSettings, embeddings: set[int]) -> MuonChoice:
    """`classify_parameter` for a model's parameter, with the settings' exclusions and the
    parameter's own `use_muon` attribute (absent: None) and its block marks
    (`is_expert_group`, the head attributes of blocks.py)."""
    forced = getattr(p, "use_muon", None)
    shape = full_shape(p)
    layout = param_block_layout(name, p, shape) if len(shape) >= 2 and shape.numel() > 0 else None
    return classify_parameter(
        name, shape, settings.muon_exclude_patterns, id(p) in embeddings, settings.muon_exclude_modules,
        None if forced is None else bool(forced), layout,
    )


def embedding_param_ids(model: nn.Module) -> set[int]:
    return {
        id(p) for module in model.modules() if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        for p in module.parameters(recurse=False)
    }


def muon_param_plan(model: nn.Module, params_cfg: Mapping[str, Any] | None = None) -> list[MuonChoice]:
    """Every trainable parameter's optimizer kind and the reason, in model order (`explain`)."""
    settings = parse_muon_params(params_cfg)
    prepare_muon_marks(model, settings.per_head_muon, settings.per_head_muon_output)
    embeddings = embedding_param_ids(model)
    return [
        classify_named_parameter(n, p, settings, embeddings) for n, p in model.named_parameters() if p.requires_grad
    ]


def split_param_groups(
    model: nn.Module, hyper: list[dict[str, Any]], group_of: dict[int, int],
    params_cfg: Mapping[str, Any] | None,
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """Split each optimizer group into its Muon part and its AdamW part (engine set-up).

    Args:
        model: the model, for names, full shapes and embedding modules.
        hyper: per group, the user's hyper-parameters (without "params"). A group that
            already says `use_muon` (DeepSpeed's MuonWithAuxAdam form, or the groups of a
            `zeroshard.optim.Muon`) is kept whole, after checking its parameters are matrices.
        group_of: id(parameter) -> group index.
        params_cfg: the config's `optimizer.params` (defaults for every group).

    Returns:
        (hyper, group_of) for the new groups; each group carries "use_muon" and every
        hyper-parameter of its kind (user's group keys override the config's).
    """
    settings = parse_muon_params(params_cfg)
    prepare_muon_marks(model, settings.per_head_muon, settings.per_head_muon_output)
    embeddings = embedding_param_ids(model)
    members: list[list[tuple[str, nn.Parameter]]] = [[] for _ in hyper]
    for name, p in model.named_parameters():
        if id(p) in group_of:
            members[group_of[id(p)]].append((name, p))
    new_hyper: list[dict[str, Any]] = []
    new_group_of: dict[int, int] = {}
    for index, user in enumerate(hyper):
        if "use_muon" in user:
            use_muon = bool(user["use_muon"])
            if use_muon:
                for name, p in members[index]:
                    shape = full_shape(p)
                    if len(shape) < 2 or shape.numel() == 0:
                        raise ValueError(
                            f"optimizer group {index} has use_muon=True but parameter {name!r} has shape "
                            f"{tuple(shape)}: Muon updates whole matrices. Move it to a group with "
                            "use_muon=False."
                        )
                    param_block_layout(name, p, shape)  # bad marks fail here, before any flat
            parts = [(use_muon, members[index])]
        else:
            kinds = {
                id(p): classify_named_parameter(name, p, settings, embeddings).use_muon for name, p in members[index]
            }
            parts = [(kind, [(n, p) for n, p in members[index] if kinds[id(p)] == kind]) for kind in (True, False)]
        for use_muon, params in parts:
            if not params:
                continue
            group = settings.group_defaults(use_muon)
            group.update({k: v for k, v in user.items() if k in group or k not in MUON_KEYS + ADAM_KEYS})
            group["use_muon"] = use_muon
            for _, p in params:
                new_group_of[id(p)] = len(new_hyper)
            new_hyper.append(group)
    return new_hyper, new_group_of

