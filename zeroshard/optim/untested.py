"""`zero_allow_untested_optimizer`: the permission a user's own optimizer class needs.

The engine steps an optimizer on flat tensors (several parameters in one, a shard of them
at stages 1-3), never on the module's parameters. That is exact for an optimizer whose
update is elementwise (each entry's new value depends on that entry's gradient and state
only) and wrong, silently, for one that reads a parameter's shape or norm (Adafactor's
factored moments, LAMB's trust ratio, LBFGS). DeepSpeed 0.19 refuses a client optimizer
outside its tested list under ZeRO unless the config sets the key; so does zeroshard, with
a list of the elementwise optimizers it steps exactly.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.optim.cpu_adam import DeepSpeedCPUAdam
from zeroshard.optim.muon.optimizer import Muon, ShardedMuon
from zeroshard.optim.state_dtype_adamw import StateDtypeAdamW

# Exact classes (as DeepSpeed compares them): a subclass may override `step`.
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam,
    DeepSpeedCPUAdam, StateDtypeAdamW,
)
# zeroshard's own, which step whole matrices on the ranks that own them (zeroshard/optim/muon).
ZEROSHARD_OPTIMIZERS: tuple[type, ...] = (Muon, ShardedMuon)


def check_client_optimizer(optimizer: Any, allowed: bool) -> None:
    """Refuse a user optimizer of a class not known to step flat shards exactly, unless ``allowed``.

    Raises:
        ValueError: naming the class and the key that permits it.
    """
    if allowed or not isinstance(optimizer, torch.optim.Optimizer):
        return
    if type(optimizer) in ELEMENTWISE_OPTIMIZERS + ZEROSHARD_OPTIMIZERS:
        return
    known = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"optimizer: {type(optimizer).__name__} is untested with ZeRO. The engine steps it on flat "
        "tensors (shards of several parameters), which is exact only for an elementwise update "
        "(no per-parameter shape or norm). If yours is elementwise, set "
        '"zero_allow_untested_optimizer": true in the config (as DeepSpeed asks); otherwise use one of '
        f"{known}, or the config's 'optimizer' section."
    )
