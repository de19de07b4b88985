"""One training state in a layout of neither engine: whole tensors by parameter name.

Converting between DeepSpeed's checkpoints and zeroshard's goes through `PortableState`: the
readers (read_ds.py, universal.py, zs_format.py's `read_zeroshard`) assemble every parameter and
its optimizer state from the saving run's shards, the writers (zs_format.py's `write_zeroshard`,
write_ds.py) cut them into the target's.
Only elements move, so masters and optimizer state come out bitwise the saved ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

# The optimizer state zeroshard and DeepSpeed both keep per element for Adam and AdamW.
ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq")
# Muon's per-element state on its matrices (its auxiliary AdamW keeps ADAM_STATE_KEYS).
MUON_STATE_KEY = "momentum_buffer"
STATE_KEYS = (*ADAM_STATE_KEYS, MUON_STATE_KEY)
# The optimizer_class of a Muon state; zeroshard's engine saves its optimizer as ShardedMuon.
MUON_CLASS = "Muon"


@dataclass
class PortableState:
    """Everything a resume needs, unsharded. Tensors are full-shape, on the CPU."""

    groups: list[list[str]]  # optimizer param groups: the trainable parameters' names, in order
    masters: dict[str, torch.Tensor]  # fp32 master weights
    optimizer_state: dict[str, dict[str, torch.Tensor]]  # name -> {"exp_avg": ..., ...}
    steps: list[float | None]  # each param group's optimizer step count
    hyper: list[dict[str, Any]]  # each param group's hyper-parameters (lr, betas, ...), no "params"
    optimizer_class: str  # "AdamW", "Adam", "Muon" (each group's hyper says use_muon)
    module_keys: list[str]  # the model's state_dict keys, in order
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    frozen: dict[str, torch.Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> the name that owns it
    global_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0
    lr_scheduler: dict[str, Any] | None = None
    loss_scaler: dict[str, Any] = field(default_factory=lambda: {"kind": "none"})  # zeroshard's form
    client_state: dict[str, Any] = field(default_factory=dict)
    stage: int = 0
    world_size: int = 1
    precision: str = "fp32"  # "fp32", "bf16" or "fp16": the 16-bit type of the module, if any
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for group in self.groups for name in group]

    @property
    def param_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
