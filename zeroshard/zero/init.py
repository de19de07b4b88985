"""`zeroshard.zero.Init`: build a model with only each rank's part of every parameter (stage 3).

[Note: what Init does]
Inside the context at stage 3, every `nn.Module` constructed runs its `__init__` as usual (its
parameters are created whole, with their normal initialisation) and then, when its own
`__init__` has returned, each of its parameters not yet partitioned is partitioned: broadcast
from the first rank of the partition group (so every rank keeps the same values the engine
would have broadcast without Init), then only this rank's part is kept, on the host
(zeroshard/zero/partition.py). A parameter then reads as empty (numel 0) with `ds_shape` and
`ds_numel`, as stage-3 parameters do between gathers. So the host's peak while the model is
built is about one module's full parameters (the largest module that creates parameters of its
own, e.g. an embedding) plus the parts: 1/W of the model on each rank. Buffers are not
partitioned. `initialize` gathers one unit's parameters at a time from their parts, builds the
unit's flat from them and frees them (zeroshard/engine/engine.py), so the trained values equal a model
built without Init, bitwise.

How construction is intercepted: on entry the `__init__` of every `nn.Module` subclass is
wrapped (and `nn.Module.__init_subclass__` wraps classes defined inside the context), as
DeepSpeed's Init does; on exit the originals come back. The wrapper of the outermost `__init__`
of an instance (a `super().__init__` chain runs once) partitions after it.

[Note: parameters read after they were partitioned]
A module's `__init__` may touch a parameter of a child built earlier in it (HF's
`_init_weights`, `self.embed.weight.normal_()`), or tie one (`self.head.weight =
self.embed.weight`: tying needs no values, it shares the parameter object, which stays
partitioned). While the context is active a torch function mode watches every torch operation:
one that reads or writes a partitioned parameter's values gathers the parameter first (a
collective: every rank's constructor does the same), runs, and the parameter is partitioned
again when the `__init__` that touched it returns (or, for code in the with-block outside any
module's `__init__`, when the context exits), from its new values. Reading its metadata
(`shape`, `numel()`, `requires_grad`, ...) does not gather: it is empty there, as documented.
`zeroshard.zero.GatheredParameters(params, modifier_rank=r)` gathers explicitly, also on a
model built under Init before `initialize`.

Below stage 3 (and with `enabled=False`) the context does nothing at all.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zeroshard.comm import collectives as comm
from zeroshard.sharding.layout import current_layout
from zeroshard.zero import partition as parts
from zeroshard.zero.init_config import without_placeholders
from zeroshard.zero.partition import PartitionSpec

__all__ = ["Init"]

# Metadata reads that never gather: the parameter answers as the empty tensor it is.
_METADATA_GETTERS = frozenset({
    "requires_grad", "grad_fn", "is_leaf", "grad", "dtype", "device", "shape", "layout", "ndim", "names",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "_backward_hooks", "_post_accumulate_grad_hooks",
})
_METADATA_METHODS = frozenset({
    "numel", "dim", "size", "ndimension", "nelement", "element_size", "is_floating_point", "is_complex",
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__repr__", "__format__",
    "__hash__", "data_ptr", "get_device", "is_contiguous", "untyped_storage", "_is_view",
})


def _names(func: Callable) -> tuple[str, str | None]:
    """(function name, attribute name for a property's __get__/__set__)."""
    name = getattr(func, "__name__", "")
    owner = getattr(func, "__self__", None)
    return name, getattr(owner, "__name__", None) if name in ("__get__", "__set__") else None


class _State:
    """The active Init context and the modules whose `__init__` is running."""

    def __init__(self) -> None:
        self.init: Init | None = None
        self.constructing: set[int] = set()  # id() of instances inside their outermost __init__
        # One list per running outermost __init__: parameters gathered on access during it.
        self.touched: list[list[nn.Parameter]] = []
        self.touched_outside: list[nn.Parameter] = []  # gathered by code outside any __init__
        self.originals: dict[type, Callable] = {}
        self.old_init_subclass: Any = None
        self.busy = False  # Init's own partitioning runs: the mode passes everything through


_STATE = _State()


class _GatherOnAccess(TorchFunctionMode):
    """Gathers a partitioned parameter that an operation reads or writes (the note above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        init = _STATE.init
        if init is not None and not _STATE.busy:
            name, attribute = _names(func)
            if attribute == "data" and name == "__set__" and args and parts.was_partitioned(args[0]):
                # `p.data = value`: no gather (the old values are replaced); `value` is what gets
                # partitioned again.
                target = args[0]
                result = func(*args, **kwargs)
                target.ds_tensor = None
                init._note_touched(target)
                return result
            skip = attribute in _METADATA_GETTERS if attribute is not None else name in _METADATA_METHODS
            if not skip:
                leaves, _ = tree_flatten((args, kwargs))
                for leaf in leaves:
                    if isinstance(leaf, nn.Parameter) and parts.is_partitioned(leaf):
                        parts.gather(leaf)
                        init._note_touched(leaf)
        return func(*args, **kwargs)


def _wrap_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        init = _STATE.init
        if init is None or id(module) in _STATE.constructing:
            return original(module, *args, **kwargs)  # outside Init, or a super().__init__ call
        _STATE.constructing.add(id(module))
        _STATE.touched.append([])
        try:
            original(module, *args, **kwargs)
        finally:
            touched = _STATE.touched.pop()
            _STATE.constructing.discard(id(module))
        init._after_module_init(module, touched)

    __init__._zeroshard_original = original  # type: ignore[attr-defined]
    return __init__


def _all_subclasses(cls: type) -> list[type]:
    found, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                todo.append(sub)
    return found


class Init:
    """`with zeroshard.zero.Init(config_dict_or_path=ds_config): model = MyModel()`.

    DeepSpeed's signature (deepspeed.zero.Init, 0.19). Implemented: `module` (partition an
    already built module now, as if built in the context), `data_parallel_group` (the ranks to
    partition over; default every rank), `config_dict_or_path` / `config` (checked now; its
    stage decides whether anything happens), `enabled`, `dtype` (the dtype floating parameters
    are kept in from the start, e.g. torch.bfloat16), `remote_device` None or "cpu" (parts
    live on the host), `pin_memory`. Accepted with no effect: `mem_efficient_linear` (a
    memory-saving linear autograd function in DeepSpeed; the values are the same) and
    `tensor_overrides`. Refused, each naming itself: `remote_device="nvme"`, `mpu`,
    `zero_param_parallel_group`, `zero_quantized_weights`, `zero_quantized_nontrainable_weights`,
    `sequence_data_parallel_group`, `param_swapper`.

    Attributes:
        config: the resolved config, or None when none was given.
        stage: its ZeRO stage (None without a config: then Init partitions, as DeepSpeed's does).
        active: whether this context partitions (stage 3, or no config; and enabled).
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        zero_param_parallel_group: Any = None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        sequence_data_parallel_group: Any = None,
        param_swapper: Any = None,
        tensor_overrides: Any = None,
    ) -> None:
        from zeroshard.resolve import resolve_config

        self.enabled = enabled
        refused = {
            "mpu": mpu is not None,
            "zero_param_parallel_group": zero_param_parallel_group is not None,
            "zero_quantized_weights": bool(zero_quantized_weights),
            "zero_quantized_nontrainable_weights": bool(zero_quantized_nontrainable_weights),
            "sequence_data_parallel_group": sequence_data_parallel_group is not None,
            "param_swapper": param_swapper is not None,
        }
        for option, given in refused.items():
            if given:
                raise NotImplementedError(
                    f"zeroshard.zero.Init({option}=...): not supported by zeroshard (no tensor parallelism, hpZ, "
                    f"weight quantization or NVMe swapping). Leave {option} at its default."
                )
        if remote_device not in (None, "cpu"):
            raise NotImplementedError(
                f"zeroshard.zero.Init(remote_device={remote_device!r}): only None or 'cpu' (the parts live in "
                "host memory); NVMe is not supported. Leave remote_device unset."
            )
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"zeroshard.zero.Init(dtype={dtype!r}): a floating torch.dtype, e.g. torch.bfloat16.")
        raw = config_dict_or_path if config_dict_or_path is not None else config
        if enabled and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            from zeroshard.launch.distributed import init_distributed

            init_distributed()  # as DeepSpeed's Init does (a no-op without a launcher's environment)
        # Without "auto" values: zeroshard/zero/init_config.py (Init runs before the HF integration fills them).
        self.config = (
            resolve_config(without_placeholders(raw), world_size=comm.world_size())
            if (enabled and raw is not None) else None
        )
        self.stage = self.config.zero_optimization.stage if self.config is not None else None
        self.active = enabled and self.stage in (None, 3)
        self._spec: PartitionSpec | None = None
        self._entered = False
        if self.active:
            group = current_layout().world if data_parallel_group is None else comm.as_group(data_parallel_group)
            self._spec = PartitionSpec(group, dtype, bool(pin_memory) and torch.cuda.is_available())
        if module is not None and self.active:
            self._partition_tree(module)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Init:
        if not self.active or _STATE.init is not None:
            return self  # inactive, or nested inside another Init: the outer one partitions
        self._entered = True
        _STATE.init = self
        for cls in [nn.Module, *_all_subclasses(nn.Module)]:
            _patch(cls)
        _STATE.old_init_subclass = nn.Module.__dict__.get("__init_subclass__")

        old = _STATE.old_init_subclass

        def init_subclass(cls: type, **kwargs: Any) -> None:
            if old is not None:
                old.__get__(None, cls)(**kwargs)
            else:
                super(nn.Module, cls).__init_subclass__(**kwargs)
            _patch(cls)

        nn.Module.__init_subclass__ = classmethod(init_subclass)  # type: ignore[assignment]
        self._mode = _GatherOnAccess()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self._entered:
            return None
        self._entered = False
        try:
            self._mode.__exit__(*exc_info)
        finally:
            for cls, original in _STATE.originals.items():
                cls.__init__ = original  # type: ignore[misc]
            _STATE.originals.clear()
            if _STATE.old_init_subclass is None:
                del nn.Module.__init_subclass__
            else:
                nn.Module.__init_subclass__ = _STATE.old_init_subclass  # type: ignore[assignment]
            _STATE.init = None
            outside, _STATE.touched_outside = _STATE.touched_outside, []
        if exc_info[0] is None:
            self._repartition(outside)
        return None

    # --------------------------------------------------------------- partitioning
    def _note_touched(self, p: nn.Parameter) -> None:
        target = _STATE.touched[-1] if _STATE.touched else _STATE.touched_outside
        if not any(q is p for q in target):
            target.append(p)

    def _after_module_init(self, module: nn.Module, touched: list[nn.Parameter]) -> None:
        """A module's outermost `__init__` returned: partition what it created or touched."""
        self._partition_tree(module)
        self._repartition(touched)

    def _partition_tree(self, module: nn.Module) -> None:
        # Recursive: a parameter a parent assigns to a child after the child was built is
        # partitioned here too. Already partitioned ones are skipped.
        assert self._spec is not None
        with _busy():
            for p in module.parameters():
                if not parts.was_partitioned(p):
                    parts.partition(p, self._spec)

    def _repartition(self, params: list[nn.Parameter]) -> None:
        with _busy():
            for p in params:
                if parts.was_partitioned(p) and not parts.is_partitioned(p):
                    parts.partition(p, getattr(p, parts._INFO))


@contextlib.contextmanager
def _busy() -> Iterator[None]:
    previous, _STATE.busy = _STATE.busy, True
    try:
        yield
    finally:
        _STATE.busy = previous


def _patch(cls: type) -> None:
    original = cls.__dict__.get("__init__")
    if original is None or cls in _STATE.originals or getattr(original, "_zeroshard_original", None):
        return
    _STATE.originals[cls] = original
    cls.__init__ = _wrap_init(original)  # type: ignore[misc]


def gather_partitioned(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """GatheredParameters on a model built under Init, before `initialize`: make the
    partitioned ones of `params` whole (a collective); returns them, for `release_partitioned`."""
    gathered = [p for p in params if parts.is_partitioned(p)]
    with _busy():
        for p in gathered:
            parts.gather(p)
    return gathered


def release_partitioned(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Partition `params` again; with `modifier_rank`, from that rank's values (a collective)."""
    with _busy(), torch.no_grad():
        for p in params:
            spec: PartitionSpec = getattr(p, parts._INFO)
            if modifier_rank is not None:
                value = p.data.contiguous()
                comm.broadcast(value, group=spec.group, src=modifier_rank, tag="zero_init")
                p.data = value
            parts.partition(p, spec)
