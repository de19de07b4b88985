"""Stage 3: a unit's parameter used as a bare tensor by code outside the unit.

[Note: direct use of a unit's parameter]
Module hooks gather a unit when its module, or any of its submodules, runs (schedule.py).
A model can also read a unit's parameter as a tensor from code the unit does not own: the
root's `h @ self.blocks[0].fc.weight`, `F.linear(x, self.blocks[1].fc.weight)`, another unit's
forward using it, or a weight shared by reference (an lm head tied to an embedding that is a
unit of its own). No module hook sees these. While the root module's forward runs (only at
stage 3, only when some unit is sharded), every parameter of a sharded unit whose module is not
running has the class `WatchedParameter`, an `nn.Parameter` subclass with a `__torch_function__`: every torch
function given such a parameter (an op, a method, a property; inside a list too, as torch.cat
takes them) calls it, and it has the schedule gather that unit before the function runs (`use`)
and keep it gathered until the end of the backward that follows (see ParamSchedule's pins).
The schedule flips a unit's parameters back to `nn.Parameter` while its module (or one of its
submodules) runs, and all of them when the root forward ends, so the unit's own code and
everything outside the forward (backward, step, checkpoints) dispatch as before.

What counts as a use: any function that reads values (an op, `.data`, `.T`, printing).
Metadata (`shape`, `dtype`, `size()`, `requires_grad`, ...) is answered from the tensor as it
is, without a collective: outside a gather that is the empty tensor (`p.ds_shape` has the full
shape), so that reading metadata on one rank only (a log line) cannot hang the others.

[Note: why a parameter class, not a TorchFunctionMode]
A TorchFunctionMode active during the forward sees the same uses, but every torch function
of the forward goes through Python for it, and functions written in Python (F.dropout,
F.layer_norm, Tensor.split) through torch's slower generic override path: stage 3 spent about
5% more CPU time in its forward, with a mode whose body did nothing. A tensor subclass costs
nothing for a function that takes no watched parameter, which is every function of a model
that uses its parameters only in their own units; switching a unit's parameters' class costs
about 0.2 us per parameter at each unit's forward and at the root's.
What a subclass does not do that a mode would: see a parameter passed along with a tensor
subclass of the user's whose `__torch_function__` handles the call without deferring to the
other types (torch's dispatch then never asks ours); and a function given a watched parameter
runs with subclass dispatch off, so such a user subclass passed with it is not asked either.
benchmarks/direct_use_mode.py measures the forward with the watch on and off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

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


class DirectUseMode:
    """Watches the parameters it is told to (`watch`), while armed (`arm` and `disarm`, around
    the root forward). A torch function given a watched parameter calls `find(args, kwargs)`;
    when it names units used from outside, `use(units)` runs before the function and
    `wrap(output, units)` after it (not for in-place functions, whose output is their input)."""

    def __init__(
        self,
        find: Callable[[tuple, dict], list | None],
        use: Callable[[list], None],
        wrap: Callable[[Any, list], Any],
    ) -> None:
        self._find, self._use, self._wrap = find, use, wrap
        # A class of its own, so that a function finds this mode from the parameter's type.
        self._watched = type("WatchedParameter", (WatchedParameter,), {"_mode": self, "__module__": __name__})
        self.armed = False

    def arm(self) -> None:
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def watch(self, params: list[nn.Parameter], watched: bool) -> None:
        """Give `params` the watched class (`watched`, and only while armed) or back the plain one."""
        cls = self._watched if watched and self.armed else nn.Parameter
        for p in params:
            p.__class__ = cls

    def intercept(self, func, args: tuple, kwargs: dict):
        units = self._find(args, kwargs)
        if not units or not _is_value_read(func):
            return func(*args, **kwargs)
        self._use(units)
        output = func(*args, **kwargs)
        if _is_in_place(func, kwargs):
            return output
        return self._wrap(output, units)


class WatchedParameter(nn.Parameter):
    """The class of a parameter that `DirectUseMode.watch` watches (one subclass per mode)."""

    _mode: DirectUseMode | None = None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Subclass dispatch off inside: the function sees plain parameters, its outputs stay
        # plain tensors, and no nested function comes back here.
        with torch._C.DisableTorchFunctionSubclass():
            modes = [t._mode for t in types if issubclass(t, WatchedParameter) and t._mode is not None]
            if len(modes) == 1:
                return modes[0].intercept(func, args, kwargs)
            return _intercept_all(modes, func, args, kwargs)


def _intercept_all(modes: list[DirectUseMode], func, args: tuple, kwargs: dict):
    """Parameters of several engines' units in one call (rare): each engine gathers its own."""
    found = [(mode, units) for mode in modes if (units := mode._find(args, kwargs))]
    if not found or not _is_value_read(func):
        return func(*args, **kwargs)
    for mode, units in found:
        mode._use(units)
    output = func(*args, **kwargs)
    if _is_in_place(func, kwargs):
        return output
    for mode, units in found:
        output = mode._wrap(output, units)
    return output


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
