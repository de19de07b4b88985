"""Stage 3: a unit's parameter used as a bare tensor by code outside the unit.

[Note: direct use of a unit's parameter]
Module hooks gather a unit when its module, or any of its submodules, runs (param_schedule.py).
A model can also read a unit's parameter as a tensor from code the unit does not own: the
root's `h @ self.blocks[0].fc.weight`, `F.linear(x, self.blocks[1].fc.weight)`, another unit's
forward using it, or a weight shared by reference (an lm head tied to an embedding that is a
unit of its own). No module hook sees these. `DirectUseMode`, a TorchFunctionMode that is active
during the root module's forward (only at stage 3, only when some unit is sharded), sees every
torch function's arguments: when one of them is a parameter of a sharded unit whose module is
not running, the schedule gathers that unit before the function runs (`use`) and keeps it
gathered until the end of the backward that follows (see ParamSchedule's pins).

What counts as a use: any function that reads values (an op, `.data`, `.T`, printing).
Metadata (`shape`, `dtype`, `size()`, `requires_grad`, ...) is answered from the tensor as it
is, without a collective: outside a gather that is the empty tensor (`p.ds_shape` has the full
shape), so that reading metadata on one rank only (a log line) cannot hang the others.

The cost is one Python call per torch function in the forward, plus a scan of its arguments
(benchmarks/direct_use_mode.py measures it on the demo model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Tensor properties whose getter returns a tensor aliasing the values: a use.
_VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag"})
# Tensor methods that read metadata only: never a use.
_METADATA_METHODS = frozenset(
    getattr(torch.Tensor, name)
    for name in (
        "size", "dim", "ndimension", "numel", "nelement", "stride", "element_size", "is_contiguous",
        "data_ptr", "untyped_storage", "storage_offset", "is_floating_point", "is_complex",
        "get_device", "__len__", "__hash__", "register_hook", "register_post_accumulate_grad_hook",
    )
    if hasattr(torch.Tensor, name)
)


def _is_value_read(func: Any) -> bool:
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in _VALUE_PROPERTIES
    if name in ("__set__", "__delete__"):
        return False
    return func not in _METADATA_METHODS


def _is_in_place(func: Any, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.endswith("__"))


class DirectUseMode(TorchFunctionMode):
    """Calls `find(args, kwargs)` for every torch function; when it names units used from
    outside, `use(units)` before the function runs and `wrap(output, units)` after it (not
    for in-place functions, whose output is their input)."""

    def __init__(
        self,
        find: Callable[[tuple, dict], list | None],
        use: Callable[[list], None],
        wrap: Callable[[Any, list], Any],
    ) -> None:
        super().__init__()
        self._find, self._use, self._wrap = find, use, wrap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        units = self._find(args, kwargs)
        if not units or not _is_value_read(func):
            return func(*args, **kwargs)
        self._use(units)
        output = func(*args, **kwargs)
        if _is_in_place(func, kwargs):
            return output
        return self._wrap(output, units)


def param_finder(owner: dict[int, Any], outside: Callable[[Any], bool]) -> Callable[[tuple, dict], list | None]:
    """A `find` for DirectUseMode: the units (values of `owner`, keyed by parameter id) of the
    parameters among the arguments (and inside list or tuple arguments, as torch.cat takes
    them) for which `outside(unit)` holds."""

    def units_of(values, found: list | None) -> list | None:
        for value in values:
            if isinstance(value, nn.Parameter):
                unit = owner.get(id(value))
                if unit is not None and outside(unit) and (found is None or unit not in found):
                    found = [unit] if found is None else [*found, unit]
            elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
                found = units_of(value, found)
        return found

    def find(args: tuple, kwargs: dict) -> list | None:
        found = units_of(args, None)
        return units_of(kwargs.values(), found) if kwargs else found

    return find
