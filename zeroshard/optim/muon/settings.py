"""Muon's config: `optimizer.params` keys, their validation and resolved defaults
(see [Note: Muon in zeroshard] in optimizer.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zeroshard.config.suggest import did_you_mean
from zeroshard.optim.muon.newton_schulz import DEFAULT_NS_STEPS, NS_DTYPE_NAMES, NS_METHODS
from zeroshard.optim.muon.qk_clip.settings import qk_clip_problems

DEFAULT_EXCLUDE_PATTERNS = ("embed", "lm_head")
# MoE routers: DeepSpeed's MoE (`deepspeed_moe.gate.wg`), Hugging Face's Mixtral, Qwen3-MoE
# and DeepSeek (`mlp.gate`), AutoEP (`router`). Matched as whole name components, so an
# MLP's `gate_proj` or a fused `gate_up_proj` still gets Muon.
DEFAULT_EXCLUDE_MODULES = ("gate", "router")
# DeepSpeed's defaults (MuonWithAuxAdam): Muon lr 0.02, momentum 0.95, gram; AdamW lr 3e-4,
# betas (0.9, 0.95), eps 1e-10; no weight decay.
MUON_LR = 0.02
ADAM_LR = 3e-4
MUON_KEYS = ("lr", "momentum", "weight_decay", "nesterov", "ns_steps", "ns_method", "ns_dtype")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
CONFIG_KEYS = frozenset(
    {"lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps",
     "nesterov", "ns_steps", "ns_dtype", "muon_exclude_patterns", "muon_exclude_modules",
     "per_head_muon", "per_head_muon_output", "qk_clip"}
)


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
    muon_exclude_modules: tuple[str, ...] = DEFAULT_EXCLUDE_MODULES
    # DeepSpeed's key: the presets tag q/k/v (and MLA's q_b_proj / kv_b_proj) with their
    # heads, rows per head (optim/muon/heads.py). zeroshard's `per_head_muon_output` adds the
    # output projection, columns per head (DeepSpeed leaves it whole).
    per_head_muon: bool = False
    per_head_muon_output: bool = False

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
            hint = did_you_mean(key, CONFIG_KEYS, known="Known keys")
            problems.append(f"optimizer.params.{key}: unknown key for optimizer type 'Muon'.{hint}")
    for key in ("lr", "muon_lr", "adam_lr", "weight_decay", "eps"):
        _number(problems, params, key, 0.0)
    _number(problems, params, "momentum", 0.0, 1.0, high_open=True)
    for key in ("nesterov", "per_head_muon", "per_head_muon_output"):
        if key in params and not isinstance(params[key], bool):
            problems.append(f"optimizer.params.{key}={params[key]!r}: must be true or false.")
    if params.get("per_head_muon_output") and not params.get("per_head_muon"):
        problems.append(
            "optimizer.params.per_head_muon_output=true needs per_head_muon=true (it extends the per-head "
            "split of q/k/v to the output projection); set both, or neither."
        )
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
    modules = params.get("muon_exclude_modules", DEFAULT_EXCLUDE_MODULES)
    if isinstance(modules, str) or not isinstance(modules, (list, tuple)) or not all(
            isinstance(s, str) and s and "." not in s for s in modules):
        problems.append(
            f"optimizer.params.muon_exclude_modules={modules!r}: must be a list of module names without "
            "dots (a parameter with one of them as a component of its dotted name uses AdamW; [] for none)."
        )
    if "qk_clip" in params:  # MuonClip (optim/muon/qk_clip/)
        problems.extend(qk_clip_problems(params["qk_clip"]))
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
        muon_exclude_modules=tuple(params.get("muon_exclude_modules", DEFAULT_EXCLUDE_MODULES)),
        per_head_muon=bool(params.get("per_head_muon", False)),
        per_head_muon_output=bool(params.get("per_head_muon_output", False)),
    )
