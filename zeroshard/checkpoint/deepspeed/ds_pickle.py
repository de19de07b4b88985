"""Writing `.pt` files that name DeepSpeed's classes, without DeepSpeed installed.

DeepSpeed's loader expects a real loss-scaler object, ZeRO's stage enum and fragment addresses
in its optimizer files. `DeepSpeedObject` subclasses made by `ds_class` pickle as references to
those classes by name (the unpickling DeepSpeed imports its own), carrying plain attributes;
`DSPickler.save_global` writes the reference without importing the module here.
"""

from __future__ import annotations

import pickle
import types
from pathlib import Path
from typing import Any

import torch


class DeepSpeedObject:
    """An object unpickled by DeepSpeed as its class `ds_global` with these attributes."""

    ds_global: tuple[str, str] = ("", "")

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def ds_class(module: str, name: str) -> type:
    return type(name, (DeepSpeedObject,), {"ds_global": (module, name), "__module__": __name__})


class _EnumValue:
    """An enum member pickled as `EnumClass(value)`, as pickle writes members of an Enum."""

    def __init__(self, cls: type, value: Any) -> None:
        self.cls, self.value = cls, value

    def __reduce__(self) -> tuple:
        return (self.cls, (self.value,))


LossScaler = ds_class("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
DynamicLossScaler = ds_class("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
FragmentAddress = ds_class("deepspeed.utils.tensor_fragment", "fragment_address")
_ZeroStageEnum = ds_class("deepspeed.runtime.zero.config", "ZeroStageEnum")


def zero_stage_enum(stage: int) -> _EnumValue:
    return _EnumValue(_ZeroStageEnum, int(stage))


class DSPickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def save_global(self, obj: Any, name: str | None = None) -> None:
        ref = obj.ds_global if isinstance(obj, type) and issubclass(obj, DeepSpeedObject) else None
        if ref is None:
            super().save_global(obj, name)
            return
        module, qualname = ref
        if self.proto >= 4:
            self.save(module)
            self.save(qualname)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
        self.memoize(obj)


_MODULE = types.ModuleType("zeroshard_deepspeed_pickle")
_MODULE.Pickler = DSPickler  # type: ignore[attr-defined]
_MODULE.Unpickler = pickle.Unpickler  # type: ignore[attr-defined]
_MODULE.dump = lambda obj, f, protocol=None: DSPickler(f, protocol).dump(obj)  # type: ignore[attr-defined]


def save_pt(obj: Any, path: Path) -> None:
    """torch.save through DSPickler (DeepSpeed's own files use torch.save's defaults too)."""
    torch.save(obj, path, pickle_module=_MODULE)
