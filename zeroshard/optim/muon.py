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
included), and a name that contains none of `muon_exclude_patterns` ("embed", "lm_head").
A 3-D parameter is a stack of matrices [E, rows, cols] (experts), orthogonalized one by one;
4-D and more (conv) is viewed as (out, rest). The engine puts the two kinds into separate
optimizer groups (`split_param_groups`), so each flat buffer, and hence each master tensor,
holds one kind only: Muon masters keep one state tensor ("momentum_buffer"), AdamW masters
two ("exp_avg", "exp_avg_sq") plus "step", all laid out like the master (full at stage 0,
the shard at stages 1-3), so checkpoints save, load and reshard them like any state.

Only NS needs whole matrices. Each matrix of a flat has an owner rank (balanced by NS work,
the same on every rank). A step on a Muon master: update m and u on this rank's range;
all-gather u when the master is a shard (stages 1-3); each owner orthogonalizes its
matrices (same-shape ones batched) into a packed buffer; one all-gather of the packed
buffers gives every rank every O; each rank applies O to its own range. With one rank the
same code runs without communication. Newton-Schulz always sees the full, fully reduced
matrix, so every stage computes the same update and all ranks apply identical values.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..gather import GatherPiece, all_gather_shards
from ..ranges import overlap
from .foreach_adamw import adamw_foreach
from .newton_schulz import (
    DEFAULT_NS_STEPS,
    NS_DTYPE_NAMES,
    NS_METHODS,
    ns_input_dtype,
    orthogonalize,
    resolve_ns_dtype,
    update_scale,
)

if TYPE_CHECKING:
    from ..flat import FlatParamGroup

__all__ = [
    "DEFAULT_EXCLUDE_PATTERNS",
    "Muon",
    "MuonChoice",
    "MuonSettings",
    "ShardedMuon",
    "assign_owners",
    "build_muon",
    "classify_parameter",
    "is_muon_requested",
    "matrix_layout",
    "muon_param_plan",
    "muon_param_problems",
    "parse_muon_params",
    "split_param_groups",
]

DEFAULT_EXCLUDE_PATTERNS = ("embed", "lm_head")
# DeepSpeed's defaults (MuonWithAuxAdam): Muon lr 0.02, momentum 0.95, gram; AdamW lr 3e-4,
# betas (0.9, 0.95), eps 1e-10; no weight decay.
MUON_LR = 0.02
ADAM_LR = 3e-4
_MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_steps", "ns_method", "ns_dtype")
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_KEYS = frozenset(
    {"lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps",
     "nesterov", "ns_steps", "ns_dtype", "muon_exclude_patterns"}
)


# ------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class MuonSettings:
    """The resolved `optimizer.params` of a Muon config (DeepSpeed's keys plus ours).

    `lr` sets both kinds' learning rate; `muon_lr` and `adam_lr` override it per kind
    (as in DeepSpeed). `nesterov` and `ns_steps` are honoured (DeepSpeed ignores them).
    """

    muon_lr: float = MUON_LR
    adam_lr: float = ADAM_LR
    momentum: float = 0.95
    weight_decay: float = 0.0
    nesterov: bool = True
    ns_steps: int = DEFAULT_NS_STEPS
    ns_method: str = "gram"
    ns_dtype: str = "auto"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-10
    muon_exclude_patterns: tuple[str, ...] = DEFAULT_EXCLUDE_PATTERNS

    def group_defaults(self, use_muon: bool) -> dict[str, Any]:
        """Hyper-parameters of an optimizer group of one kind."""
        if use_muon:
            return {"use_muon": True, "lr": self.muon_lr, "momentum": self.momentum,
                    "weight_decay": self.weight_decay, "nesterov": self.nesterov,
                    "ns_steps": self.ns_steps, "ns_method": self.ns_method, "ns_dtype": self.ns_dtype}
        return {"use_muon": False, "lr": self.adam_lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}


def _number(problems: list[str], params: Mapping[str, Any], key: str, low: float, high: float | None = None,
            high_open: bool = False) -> None:
    if key not in params:
        return
    value = params[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and value >= low and (high is None or (value < high if high_open else value <= high))
    if not ok:
        bound = "" if high is None else (f" and < {high}" if high_open else f" and <= {high}")
        problems.append(f"optimizer.params.{key}={value!r}: must be a number >= {low}{bound}.")


def muon_param_problems(params: Mapping[str, Any] | None) -> list[str]:
    """Every problem of a Muon config's `optimizer.params`, each naming its key (the config
    validation reports them with the rest of the config's problems)."""
    params = dict(params or {})
    problems: list[str] = []
    for key in params:
        if key not in CONFIG_KEYS:
            close = difflib.get_close_matches(key, sorted(CONFIG_KEYS), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else f" Known keys: {', '.join(sorted(CONFIG_KEYS))}."
            problems.append(f"optimizer.params.{key}: unknown key for optimizer type 'Muon'.{hint}")
    for key in ("lr", "muon_lr", "adam_lr", "weight_decay", "eps"):
        _number(problems, params, key, 0.0)
    _number(problems, params, "momentum", 0.0, 1.0, high_open=True)
    if "nesterov" in params and not isinstance(params["nesterov"], bool):
        problems.append(f"optimizer.params.nesterov={params['nesterov']!r}: must be true or false.")
    steps = params.get("ns_steps", DEFAULT_NS_STEPS)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        problems.append(f"optimizer.params.ns_steps={steps!r}: must be an integer >= 1.")
    if params.get("ns_method", "gram") not in NS_METHODS:
        problems.append(
            f"optimizer.params.ns_method={params['ns_method']!r}: must be one of {', '.join(NS_METHODS)}."
        )
    ns_dtype = params.get("ns_dtype", "auto")
    if not isinstance(ns_dtype, str) or ns_dtype.lower() not in NS_DTYPE_NAMES:
        problems.append(f"optimizer.params.ns_dtype={ns_dtype!r}: must be one of {', '.join(NS_DTYPE_NAMES)}.")
    betas = params.get("betas", (0.9, 0.95))
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2
            and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
        problems.append(f"optimizer.params.betas={betas!r}: must be two numbers in [0, 1).")
    patterns = params.get("muon_exclude_patterns", DEFAULT_EXCLUDE_PATTERNS)
    if isinstance(patterns, str) or not isinstance(patterns, (list, tuple)) or not all(
            isinstance(s, str) and s for s in patterns):
        problems.append(
            f"optimizer.params.muon_exclude_patterns={patterns!r}: must be a list of non-empty "
            "name substrings (parameters whose name contains one use AdamW)."
        )
    return problems


def parse_muon_params(params: Mapping[str, Any] | None) -> MuonSettings:
    """Validate a Muon config's `optimizer.params` and resolve its defaults.

    Raises:
        ValueError: every problem at once, each naming its key.
    """
    params = dict(params or {})
    problems = muon_param_problems(params)
    if problems:
        raise ValueError("invalid Muon optimizer config:\n  " + "\n  ".join(problems))
    steps = params.get("ns_steps", DEFAULT_NS_STEPS)
    ns_dtype = params.get("ns_dtype", "auto")
    betas = params.get("betas", (0.9, 0.95))
    patterns = params.get("muon_exclude_patterns", DEFAULT_EXCLUDE_PATTERNS)
    lr = params.get("lr")
    return MuonSettings(
        muon_lr=float(params.get("muon_lr", lr if lr is not None else MUON_LR)),
        adam_lr=float(params.get("adam_lr", lr if lr is not None else ADAM_LR)),
        momentum=float(params.get("momentum", 0.95)),
        weight_decay=float(params.get("weight_decay", 0.0)),
        nesterov=bool(params.get("nesterov", True)),
        ns_steps=int(steps),
        ns_method=str(params.get("ns_method", "gram")),
        ns_dtype=ns_dtype.lower(),
        betas=(float(betas[0]), float(betas[1])),
        eps=float(params.get("eps", 1e-10)),
        muon_exclude_patterns=tuple(patterns),
    )


# ------------------------------------------------------------------------ classification
@dataclass(frozen=True)
class MuonChoice:
    """Which optimizer one parameter gets, and why (for `explain`)."""

    name: str
    shape: tuple[int, ...]
    use_muon: bool
    reason: str


def matrix_layout(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, rows, cols): how a parameter of full shape `shape` is orthogonalized.

    2-D is one matrix; 3-D is a stack of `shape[0]` matrices (stacked expert weights);
    4-D and more (conv weights) is one (out, rest) matrix.
    """
    if len(shape) < 2:
        raise ValueError(f"shape {tuple(shape)} is not a matrix")
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    return 1, shape[0], math.prod(shape[1:])


def classify_parameter(
    name: str, shape: Sequence[int], exclude_patterns: Sequence[str] = DEFAULT_EXCLUDE_PATTERNS,
    is_embedding: bool = False,
) -> MuonChoice:
    """Muon or AdamW for one parameter, decided on its full shape and name."""
    shape = tuple(shape)
    if len(shape) < 2:
        return MuonChoice(name, shape, False, f"{len(shape)}-D")
    if math.prod(shape) == 0:
        return MuonChoice(name, shape, False, "empty")
    if is_embedding:
        return MuonChoice(name, shape, False, "nn.Embedding weight")
    for pattern in exclude_patterns:
        if pattern in name:
            return MuonChoice(name, shape, False, f"name contains {pattern!r}")
    count, rows, cols = matrix_layout(shape)
    if len(shape) == 2:
        reason = f"matrix {rows}x{cols}"
    elif len(shape) == 3:
        reason = f"{count} stacked matrices {rows}x{cols}"
    else:
        reason = f"{len(shape)}-D, viewed as {rows}x{cols}"
    return MuonChoice(name, shape, True, reason)


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {
        id(p) for module in model.modules() if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
        for p in module.parameters(recurse=False)
    }


def _full_shape(p: nn.Parameter) -> torch.Size:
    """The parameter's full shape, also while it is empty (built under zero.Init, or freed at stage 3)."""
    return torch.Size(getattr(p, "ds_shape", p.shape)) if p.numel() == 0 else p.shape


def muon_param_plan(model: nn.Module, params_cfg: Mapping[str, Any] | None = None) -> list[MuonChoice]:
    """Every trainable parameter's optimizer kind and the reason, in model order (`explain`)."""
    settings = parse_muon_params(params_cfg)
    embeddings = _embedding_param_ids(model)
    return [
        classify_parameter(n, _full_shape(p), settings.muon_exclude_patterns, id(p) in embeddings)
        for n, p in model.named_parameters() if p.requires_grad
    ]


# ---------------------------------------------------------------------- engine grouping
def is_muon_requested(optimizer: Any, optimizer_config: Any) -> bool:
    """Whether the engine must build Muon: a `zeroshard.optim.Muon` instance was passed, or
    none was and the config's optimizer type is Muon."""
    if isinstance(optimizer, Muon):
        return True
    return optimizer is None and optimizer_config is not None and optimizer_config.type.lower() == "muon"


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
    embeddings = _embedding_param_ids(model)
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
                    shape = _full_shape(p)
                    if len(shape) < 2 or shape.numel() == 0:
                        raise ValueError(
                            f"optimizer group {index} has use_muon=True but parameter {name!r} has shape "
                            f"{tuple(shape)}: Muon updates whole matrices. Move it to a group with "
                            "use_muon=False."
                        )
            parts = [(use_muon, members[index])]
        else:
            kinds = {
                id(p): classify_parameter(
                    name, _full_shape(p), settings.muon_exclude_patterns, id(p) in embeddings
                ).use_muon
                for name, p in members[index]
            }
            parts = [(kind, [(n, p) for n, p in members[index] if kinds[id(p)] == kind]) for kind in (True, False)]
        for use_muon, params in parts:
            if not params:
                continue
            group = settings.group_defaults(use_muon)
            group.update({k: v for k, v in user.items() if k in group or k not in _MUON_KEYS + _ADAM_KEYS})
            group["use_muon"] = use_muon
            for _, p in params:
                new_group_of[id(p)] = len(new_hyper)
            new_hyper.append(group)
    return new_hyper, new_group_of


# ------------------------------------------------------------------------- shared maths
def _state_tensor(state: dict[str, Any], key: str, like: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if key not in state:
        state[key] = torch.zeros_like(like, dtype=dtype or like.dtype)
    return state[key]


def _in_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it is fp32 or wider (updated in place), else an fp32 copy to write back."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _adamw_group_step(params: list[torch.Tensor], states: list[dict[str, Any]], group: Mapping[str, Any],
                      state_dtype: torch.dtype | None = None) -> None:
    """torch's AdamW (decoupled weight decay, bias correction) on every tensor of a group at
    once, in fp32 whatever the dtypes of the masters and of the moments (`state_dtype`,
    default each master's)."""
    adamw_foreach(
        params, [p.grad for p in params], states, lr=group["lr"], betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"], state_dtype=state_dtype,
    )


def _momentum_direction(grad: torch.Tensor, state: dict[str, Any], group: Mapping[str, Any],
                        state_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Update the momentum in `state` with `grad`; return u (Nesterov or plain momentum) in
    fp32 or wider, whatever the dtypes of the gradient and the momentum (`state_dtype`)."""
    m_t = _state_tensor(state, "momentum_buffer", grad, state_dtype)
    beta = float(group["momentum"])
    grad, m = _in_fp32(grad), _in_fp32(m_t)
    m.mul_(beta).add_(grad, alpha=1.0 - beta)
    if m is not m_t:
        m_t.copy_(m)
    if group["nesterov"]:
        return grad.mul(1.0 - beta).add_(m, alpha=beta)
    return m  # read only from here on


def _apply_update(p: torch.Tensor, update: torch.Tensor, group: Mapping[str, Any]) -> None:
    """p <- p (1 - lr wd) - lr update, in fp32 or wider."""
    lr, wd = float(group["lr"]), float(group["weight_decay"])
    param = _in_fp32(p)
    if wd != 0.0:
        param.mul_(1.0 - lr * wd)
    param.add_(update, alpha=-lr)
    if param is not p:
        p.copy_(param)


def _compute_dtype(group: Mapping[str, Any], like: torch.Tensor) -> torch.dtype:
    return resolve_ns_dtype(group["ns_dtype"], like.device, group["ns_method"], like.dtype)


def _fill_group_defaults(group: dict[str, Any]) -> None:
    if "use_muon" not in group:
        raise ValueError(
            "Muon optimizer group without 'use_muon': build the groups with split_param_groups "
            "(the engine does), or pass use_muon=True/False in every group."
        )
    for key, value in MuonSettings().group_defaults(bool(group["use_muon"])).items():
        group.setdefault(key, value)
    if group["use_muon"] and group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method={group['ns_method']!r}: must be one of {', '.join(NS_METHODS)}.")


# ----------------------------------------------------------------------- sharded Muon
def assign_owners(costs: Sequence[int], world_size: int) -> list[int]:
    """Owner rank per task, balancing total cost (largest first onto the least-loaded rank).

    Deterministic (ties go to the lower index and the lower rank), so every rank computes
    the same assignment without communicating.
    """
    loads = [0] * world_size
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += costs[index]
    return owners


@dataclass(frozen=True)
class _MatrixTask:
    """One matrix of a Muon flat: where it lives, who orthogonalizes it, where its O is packed."""

    name: str
    flat_offset: int  # first element in the full flat buffer
    rows: int
    cols: int
    scale: float
    owner: int
    pack_offset: int  # first element in its owner's packed buffer

    @property
    def numel(self) -> int:
        return self.rows * self.cols


@dataclass(frozen=True)
class _MuonLayout:
    flat: FlatParamGroup
    tasks: tuple[_MatrixTask, ...]
    pack_numel: int  # elements of every rank's packed buffer (the largest owner's load)


def _muon_layout(flat: FlatParamGroup) -> _MuonLayout:
    pieces = []
    for name, shape, offset in zip(flat.names, flat.shapes, flat.offsets, strict=True):
        if len(shape) < 2 or math.prod(shape) == 0:
            raise ValueError(
                f"parameter {name!r} (shape {tuple(shape)}) is in a Muon optimizer group, but Muon "
                "updates whole matrices. Give it use_muon=False (split_param_groups does)."
            )
        count, rows, cols = matrix_layout(shape)
        for e in range(count):
            label = name if count == 1 else f"{name}[{e}]"
            pieces.append((label, offset + e * rows * cols, rows, cols))
    costs = [r * c * min(r, c) for _, _, r, c in pieces]
    owners = assign_owners(costs, flat.shard_size)  # ranks of the shard group
    loads = [0] * flat.shard_size
    tasks = []
    for (label, offset, rows, cols), owner in zip(pieces, owners, strict=True):
        tasks.append(_MatrixTask(label, offset, rows, cols, update_scale(rows, cols), owner, loads[owner]))
        loads[owner] += rows * cols
    return _MuonLayout(flat, tuple(tasks), max(loads))


class ShardedMuon(torch.optim.Optimizer):
    """Muon over the engine's flat master tensors (see [Note: Muon in zeroshard]).

    Args:
        groups: optimizer groups over master tensors, each with "use_muon" and its kind's
            hyper-parameters (`split_param_groups` makes them; missing ones take defaults).
        flats: the engine's flat buffers; may be given later with `attach_flats`, before the
            first step.
        state_dtype: dtype of the momentum and moments when the precision plan wants it
            other than the masters' (bf16 masters, fp32 state); arithmetic is fp32 either way.
    """

    def __init__(
        self, groups: list[dict[str, Any]], flats: Sequence[FlatParamGroup] | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        groups = [dict(g) for g in groups]
        for group in groups:
            _fill_group_defaults(group)
        super().__init__(groups, {})
        self.state_dtype = state_dtype
        self._layouts: dict[int, _MuonLayout] = {}
        if flats is not None:
            self.attach_flats(flats)

    def attach_flats(self, flats: Sequence[FlatParamGroup]) -> None:
        """Learn which matrices each Muon master holds, and their owner ranks."""
        by_master = {id(f.master): f for f in flats}
        layouts = {}
        for group in self.param_groups:
            for p in group["params"]:
                flat = by_master.get(id(p))
                if flat is None or flat.master is not p:
                    raise ValueError("ShardedMuon: a parameter is not the master tensor of any given flat buffer.")
                if group["use_muon"]:
                    layouts[id(p)] = _muon_layout(flat)
        self._layouts = layouts

    def owner_of(self) -> dict[str, int]:
        """Matrix name -> owner rank, over every Muon master (for tests and `explain`)."""
        return {t.name: t.owner for layout in self._layouts.values() for t in layout.tasks}

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        """One Muon/AdamW step on every master; a collective at world size > 1 (all ranks
        call it together, as the engine does)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    raise RuntimeError(
                        "ShardedMuon.step: a master tensor has no gradient; the engine sets every "
                        "master's gradient (zeros for unused parameters) before stepping."
                    )
            if not group["use_muon"]:
                params = list(group["params"])
                _adamw_group_step(params, [self.state[p] for p in params], group, self.state_dtype)
                continue
            for p in group["params"]:
                self._muon_step(p, group)
        return loss

    def _muon_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        layout = self._layouts.get(id(p))
        if layout is None:
            raise RuntimeError("ShardedMuon: call attach_flats(engine.flats) before the first step.")
        flat = layout.flat
        u = _momentum_direction(p.grad, self.state[p], group, self.state_dtype)
        compute_dtype = _compute_dtype(group, p)
        master_start, master_numel = flat.master_range()
        if master_numel == flat.padded_numel:
            full_u = u
        else:
            wire = ns_input_dtype(compute_dtype, u.dtype)  # never fp16 before normalising
            full_u = torch.empty(flat.padded_numel, dtype=wire, device=u.device)
            all_gather_shards([GatherPiece(u, full_u)], group=flat.spec.shard, tag="muon", wire_dtype=wire).wait()

        packed = torch.zeros(layout.pack_numel, dtype=compute_dtype, device=p.device)
        mine: dict[tuple[int, int], list[_MatrixTask]] = {}
        for task in layout.tasks:
            if task.owner == flat.shard_rank:
                mine.setdefault((task.rows, task.cols), []).append(task)
        for (rows, cols), tasks in mine.items():
            batch = torch.stack([full_u.narrow(0, t.flat_offset, t.numel).view(rows, cols) for t in tasks])
            result = orthogonalize(batch, group["ns_steps"], group["ns_method"], compute_dtype)
            for t, o in zip(tasks, result, strict=True):
                packed.narrow(0, t.pack_offset, t.numel).copy_(o.reshape(-1))
        if flat.shard_size > 1:
            every = torch.empty(flat.shard_size * layout.pack_numel, dtype=compute_dtype, device=p.device)
            all_gather_shards([GatherPiece(packed, every)], group=flat.spec.shard, tag="muon").wait()
        else:
            every = packed

        update = torch.zeros_like(u)
        for t in layout.tasks:  # the part of each O that falls in this rank's master range
            common = overlap(t.flat_offset, t.flat_offset + t.numel, master_start, master_start + master_numel)
            if common is None:
                continue
            lo, hi = common
            source = every.narrow(0, t.owner * layout.pack_numel + t.pack_offset + lo - t.flat_offset, hi - lo)
            target = update.narrow(0, lo - master_start, hi - lo)
            target.copy_(source)
            if t.scale != 1.0:
                target.mul_(t.scale)
        _apply_update(p, update, group)


def build_muon(
    params_cfg: Mapping[str, Any] | None, groups: list[dict[str, Any]], flats: Sequence[FlatParamGroup],
    state_dtype: torch.dtype | None = None,
) -> ShardedMuon:
    """The engine's Muon: `groups` (from `split_param_groups`, "params" = master tensors)
    over `flats`. `params_cfg` is validated again so a direct caller gets the same errors."""
    parse_muon_params(params_cfg)
    return ShardedMuon(groups, flats, state_dtype)


# ------------------------------------------------------------------ single-process Muon
class Muon(torch.optim.Optimizer):
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
    ) -> None:
        cfg: dict[str, Any] = {
            "momentum": momentum, "weight_decay": weight_decay, "ns_method": ns_method,
            "betas": tuple(betas), "eps": eps, "nesterov": nesterov, "ns_steps": ns_steps,
            "ns_dtype": ns_dtype, "muon_exclude_patterns": tuple(muon_exclude_patterns),
        }
        for key, value in (("lr", lr), ("muon_lr", muon_lr), ("adam_lr", adam_lr)):
            if value is not None:
                cfg[key] = value
        settings = parse_muon_params(cfg)
        self.choices: list[MuonChoice] = []  # what was decided for named parameters
        groups = self._groups(params, settings)
        for group in groups:
            _fill_group_defaults(group)
        super().__init__(groups, {})

    def _groups(self, params: Any, settings: MuonSettings) -> list[dict[str, Any]]:
        embeddings: set[int] = set()
        if isinstance(params, nn.Module):
            embeddings = _embedding_param_ids(params)
            params = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
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
            classify_parameter(n, p.shape, settings.muon_exclude_patterns, id(p) in embeddings) for n, p in items
        ]
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
                _adamw_group_step(params, [self.state[p] for p in params], group)
                continue
            # Matrices of one shape are orthogonalized in one batched call.
            by_shape: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for p in params:
                if p.dim() < 2:
                    raise ValueError(f"Muon: a parameter of shape {tuple(p.shape)} is in a use_muon group.")
                u = _momentum_direction(p.grad, self.state[p], group)
                _, rows, cols = matrix_layout(p.shape)
                by_shape.setdefault((rows, cols), []).append((p, u.reshape(-1, rows, cols)))
            for (rows, cols), pairs in by_shape.items():
                batch = torch.cat([u for _, u in pairs])
                result = orthogonalize(batch, group["ns_steps"], group["ns_method"],
                                       _compute_dtype(group, batch))
                start = 0
                for p, u in pairs:
                    o = result[start : start + u.shape[0]].to(u.dtype)
                    start += u.shape[0]
                    scale = update_scale(rows, cols)
                    if scale != 1.0:
                        o.mul_(scale)
                    _apply_update(p, o.reshape(p.shape), group)
        return loss
