"""Reading DeepSpeed's `.pt` files without DeepSpeed and without running code from them.

DeepSpeed saves its checkpoints with `torch.save` of plain dicts that also hold a few of its
own objects: the loss scaler (`LossScaler`, `DynamicLossScaler`), ZeRO's stage enum and the
fragment addresses of ZeRO-1/2. torch's weights-only unpickler refuses those, and a full
unpickle would import DeepSpeed and run whatever callable a file names. `load_pt` instead
unpickles through `RestrictedUnpickler`: it builds only the allow-listed torch and container
types below and, for DeepSpeed's own classes, plain stand-ins that keep the saved attributes
as data (`StandIn.fields`). Any other global is refused with a `CheckpointError` naming it;
`allow_pickle=True` (the same escape as for zeroshard's own `python_state.pt`) lets other
globals load normally, which runs their code: only for files you trust.
"""

from __future__ import annotations

import collections
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

import torch

from zeroshard.checkpoint.base import CheckpointError


class StandIn:
    """A DeepSpeed object read as data: its class name and saved attributes, nothing else."""

    ds_class = "?"

    @property
    def fields(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __getitem__(self, key: str) -> Any:  # scalers and addresses read like their fields
        return self.__dict__[key]

    def __repr__(self) -> str:
        inside = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"{self.ds_class}({inside})"


def _stand_in(qualname: str) -> type:
    return type(qualname.rpartition(".")[2], (StandIn,), {"ds_class": qualname, "__module__": __name__})


class ZeroStage(int):
    """ZeRO's `ZeroStageEnum` member, read as its integer stage."""


# DeepSpeed classes a checkpoint may name, read as attribute bags.
STAND_INS: dict[str, Any] = {
    name: _stand_in(name)
    for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.fp16.loss_scaler.LossScalerBase",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
}
STAND_INS["deepspeed.runtime.zero.config.ZeroStageEnum"] = ZeroStage


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    """torch's rebuild of a tensor with Python attributes, for plain tensors and parameters only."""
    if new_type not in (torch.Tensor, torch.nn.Parameter):
        raise CheckpointError(f"a tensor of type {new_type!r}: not one this reader builds")
    return torch._tensor._rebuild_from_type_v2(func, new_type, args, state)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "device"): torch.device,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): torch._utils._rebuild_parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Builds only allow-listed globals; DeepSpeed's classes become `StandIn`s."""

    allow_pickle = False
    source = "?"

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        stand_in = STAND_INS.get(f"{module}.{name}")
        if stand_in is not None:
            return stand_in
        if self.allow_pickle:
            return super().find_class(module, name)
        raise CheckpointError(
            f"{self.source}: names {module}.{name}, which is not a type a DeepSpeed checkpoint holds; "
            "building it would run code from the file, so it is refused. If you trust this checkpoint, "
            "pass allow_pickle=True (load_checkpoint(..., allow_pickle=True), or --allow-pickle)."
        )


def _pickle_module(source: str, allow_pickle: bool) -> types.ModuleType:
    """A stand-in for the `pickle` module that torch.load uses to unpickle (its `pickle_module`)."""

    unpickler = type("Unpickler", (RestrictedUnpickler,), {"allow_pickle": allow_pickle, "source": source})
    module = types.ModuleType("zeroshard_restricted_pickle")
    module.Unpickler = unpickler  # type: ignore[attr-defined]
    module.load = lambda f, **kwargs: unpickler(f, **kwargs).load()  # type: ignore[attr-defined]
    module.__name__ = "zeroshard_restricted_pickle"
    return module


def load_pt(path: Path, allow_pickle: bool = False) -> Any:
    """A DeepSpeed `.pt` file, unpickled through `RestrictedUnpickler` onto the CPU.

    Raises:
        CheckpointError: missing, truncated or corrupt (names the file), or a global that is not
            allow-listed (names the type and the escape).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing.")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path}: not a complete torch.save archive (truncated or corrupt; its end-of-archive record is "
            "missing). Copy the file again from the run that saved it."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=False,
                          pickle_module=_pickle_module(str(path), allow_pickle))
    except CheckpointError:
        raise
    except Exception as error:  # torch and pickle raise many types for damaged data
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error}); the file is corrupt.") from None
