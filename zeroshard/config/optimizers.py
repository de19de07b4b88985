"""The optimizer names, in one table that the config, the builder and the memory estimate read.

The config accepts `optimizer.type` by this table (case-insensitively) and refuses DeepSpeed's
other optimizers by name; zeroshard/optim/build.py builds the rows built by torch
(`built_by == "torch"`), the engine builds Muon (zeroshard/optim/muon/); zeroshard/tools/memory.py
counts each row's state tensors. A new optimizer is one row here, its parameter rules
(optimizer_params.py) and its construction. In the config folder so that the schema, a leaf,
can read it without torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["OPTIMIZERS", "UNSUPPORTED_OPTIMIZERS", "OptimizerKind", "optimizer_kind"]


def _sgd_states(params: Mapping[str, Any]) -> int:
    momentum = params.get("momentum", 0.0) or 0.0
    return 1 if float(momentum) != 0.0 else 0  # torch keeps momentum_buffer only with momentum


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer the config accepts.

    Attributes:
        name: DeepSpeed's spelling (`optimizer.type`, matched case-insensitively).
        built_by: "torch" (a torch optimizer, built by zeroshard/optim/build.py) or "muon" (the
            engine's Muon, which needs the model's parameters: zeroshard/optim/muon/).
        state_tensors: elementwise state tensors per parameter, given `optimizer.params`.
    """

    name: str
    built_by: str
    state_tensors: Callable[[Mapping[str, Any]], int]

    @property
    def adam_family(self) -> bool:
        """Adam and AdamW: the same update (AdamW decouples the weight decay), the same state."""
        return self.name in ("Adam", "AdamW")


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adam": OptimizerKind("Adam", "torch", lambda params: 2),  # exp_avg, exp_avg_sq
    "adamw": OptimizerKind("AdamW", "torch", lambda params: 2),
    "sgd": OptimizerKind("SGD", "torch", _sgd_states),
    "muon": OptimizerKind("Muon", "muon", lambda params: 1),  # momentum (the AdamW side: counted apart)
}

# DeepSpeed optimizers zeroshard recognises and refuses by name (lower case -> DeepSpeed's spelling).
UNSUPPORTED_OPTIMIZERS: dict[str, str] = {
    "adagrad": "Adagrad",
    "lamb": "Lamb",
    "onebitadam": "OneBitAdam",
    "zerooneadam": "ZeroOneAdam",
    "onebitlamb": "OneBitLamb",
    "lion": "Lion",
    "muadam": "MuAdam",
    "muadamw": "MuAdamW",
    "musgd": "MuSGD",
}


def optimizer_kind(type_name: str) -> OptimizerKind | None:
    """The row of `optimizer.type` as written, or None for a type zeroshard does not build."""
    return OPTIMIZERS.get(type_name.lower())
