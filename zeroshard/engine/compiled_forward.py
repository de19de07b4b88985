"""A module's forward under torch.compile, the engine's hooks outside the graph.

[Note: compiled units]
`engine.compile()` (zeroshard/engine/compile.py) compiles each unit's module by giving it an
instance attribute `forward`, a `CompiledForward`, in place of the class's. `Module.__call__`
still runs the module's hooks itself, eagerly, around the call: stage 3's gather before the
forward and free after it, the identity whose backward gathers again for the backward
(zeroshard/sharding/schedule.py), the root's end-of-backward entry (zeroshard/grads/path.py).
Only the forward body is traced. Its backward is AOTAutograd's compiled backward; the
parameters' post-accumulate-grad hooks, which move each gradient into its flat buffer and reduce
ready units, run in the eager autograd engine after it, as they do without compile. Nothing of
zeroshard's is in a graph, so every stage, precision, accumulation, offload and checkpoint
behaves as in eager mode, and with `backend="aot_eager"` (the same kernels) the results are the
same bits (tests/dist/engine/test_compile.py). It is torchtitan's per-block compile with the
modules left where they are: parameter and state-dict names do not change.

- One graph per class, not per block: the class's forward is compiled once and called with
  the module as its first argument, so every block of the class meets the same guards
  (dynamo's cache belongs to the code object). Stage 3's hooks on a block's submodules are
  traced, but read only a flag whose value is the same in every block.
- fullgraph: a unit is compiled with `fullgraph=True` unless it holds an eager region (an MoE
  or AutoEP layer, Ulysses attention: zeroshard/comm/eager_regions.py's note) or its first
  trace breaks; then it is compiled with graph breaks and the reason is recorded
  (`CompiledForward.graph_break`). A `fullgraph` the caller gives is kept: True makes a break an
  error.
- A copy of the module (`copy.deepcopy`, the EMA pattern) or a pickled one runs its class's
  forward eagerly: the compiled forward belongs to the engine's module.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zeroshard.comm.eager_regions import eager_reason, prepare_eager_regions

logger = logging.getLogger("zeroshard")

__all__ = ["CompiledForward", "RegionReport", "compile_forward", "eager_parts", "is_compiled_module"]


@dataclass
class RegionReport:
    """What one compiled region is (`engine.compiled_regions`).

    Attributes:
        name: the module's name in the model ("" for the root).
        module_class: its class's qualified name.
        fullgraph: compiled as one graph (no break).
        eager_parts: submodule name -> why it runs eagerly (each is a graph break).
        graph_break: the first break dynamo reported where one graph was tried, else None.
    """

    name: str
    module_class: str
    fullgraph: bool
    eager_parts: dict[str, str] = field(default_factory=dict)
    graph_break: str | None = None


def eager_parts(module: nn.Module) -> dict[str, str]:
    """Submodules of `module` (itself included, as "") whose forward is an eager region."""
    found: dict[str, str] = {}
    for name, sub in module.named_modules():
        if any(name.startswith(outer + ".") for outer in found if outer):
            continue
        reason = eager_reason(type(sub).forward)
        if reason is not None:
            found[name] = reason
    return found


def is_compiled_module(module: nn.Module) -> bool:
    """Whether calling `module` runs compiled code of its own: a `CompiledForward`, an
    `nn.Module.compile()` (its `_compiled_call_impl`) or a `torch.compile(module)` wrapper."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing is compiled
    return (
        isinstance(module.__dict__.get("forward"), CompiledForward)
        or getattr(module, "_compiled_call_impl", None) is not None
        or (eval_frame is not None and isinstance(module, eval_frame.OptimizedModule))
    )


def _break_summary(error: BaseException) -> str:
    """Dynamo's first line, and the reason an eager region gave (`zeroshard: ...`), if any."""
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    marker = text.find("(reason: zeroshard: ")
    if marker < 0:
        return first
    reason = text[marker + len("(reason: "):].split(")\n", 1)[0].rstrip(")")
    return f"{first}: {reason}"


# Dynamo's compiled code belongs to the function's code object, for the whole process: once a
# forward was compiled with a graph break, every later torch.compile of it finds that code and
# runs it, fullgraph=True or not, without tracing again. So the breaks found are remembered per
# code object too, for later compilations (another engine) to report them truthfully.
_BREAKS: dict[Any, str] = {}


def _code_of(fn: Callable[..., Any]) -> Any:
    return getattr(getattr(fn, "__func__", fn), "__code__", fn)


class _Compilation:
    """One forward function under torch.compile, shared by the modules compiled with it."""

    def __init__(self, fn: Callable[..., Any], label: str, backend: Any, options: dict[str, Any],
                 fullgraph: bool | None, has_eager_parts: bool) -> None:
        self.fn = fn
        self.label = label
        self.backend = backend
        self.options = options
        # The caller's fullgraph is kept as given; otherwise one graph where nothing is eager.
        self.fixed = fullgraph is not None
        self.fullgraph = fullgraph if fullgraph is not None else not has_eager_parts
        # (A caller's fullgraph=True is passed on as it is: torch.compile's own semantics.)
        self.graph_break = None if self.fixed else _BREAKS.get(_code_of(fn))
        if self.graph_break is not None:
            self.fullgraph = False
        self.compiled = self._compile()

    def _compile(self) -> Callable[..., Any]:
        return torch.compile(self.fn, backend=self.backend, fullgraph=self.fullgraph, **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.FailOnRecompileLimitHit) as error:
            # Raised only with fullgraph=True, while tracing: nothing of the forward has run.
            if self.fixed or not self.fullgraph:
                raise
            if isinstance(error, torch._dynamo.exc.FailOnRecompileLimitHit):
                # One graph per call site: guards that differ between the modules (a Hugging Face
                # KV cache's per-layer state); past the limit dynamo runs the forward eagerly.
                summary = (f"dynamo's recompile limit ({torch._dynamo.config.recompile_limit}) reached: the "
                           "forward compiles a graph per call (TORCH_LOGS=recompiles says why); the rest run eagerly")
            else:
                summary = _break_summary(error)
            self.graph_break = _BREAKS[_code_of(self.fn)] = summary
            ours = "zeroshard:" in str(error)
            logger.log(
                logging.INFO if ours else logging.WARNING,
                "engine.compile(): %s does not compile as one graph (%s); compiled with graph breaks. "
                "Pass compile_kwargs={'fullgraph': True} to make this an error.",
                self.label, self.graph_break,
            )
            self.fullgraph = False
            self.compiled = self._compile()
            return self.compiled(*args, **kwargs)


class CompiledForward:
    """A module's `forward` (an instance attribute) that runs its compiled code: see
    [Note: compiled units]. `graph_break` and `fullgraph` report how it compiled."""

    def __init__(self, module: nn.Module, compilation: _Compilation, bound: bool,
                 original: Callable[..., Any] | None) -> None:
        self.module = module
        self.compilation = compilation
        self.bound = bound  # the compiled function is the module's own (not the class's)
        self.original = original  # the instance's `forward` before, if it had one

    @property
    def fullgraph(self) -> bool:
        return self.compilation.fullgraph

    @property
    def graph_break(self) -> str | None:
        return self.compilation.graph_break

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.bound:
            return self.compilation(*args, **kwargs)
        return self.compilation(self.module, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copied = memo.get(id(self.module))
        if self.original is not None:
            return copy.deepcopy(self.original, memo)
        if copied is None:  # the forward alone, outside its module: nothing to rebind
            return self
        return _class_forward(copied)

    def __reduce__(self):
        if self.original is not None:
            return _same, (self.original,)
        return _class_forward, (self.module,)


def _class_forward(module: nn.Module) -> Callable[..., Any]:
    return type(module).forward.__get__(module)


def _same(value: Any) -> Any:
    return value


def compile_forward(
    module: nn.Module, backend: Any = "inductor", options: dict[str, Any] | None = None,
    fullgraph: bool | None = None, label: str | None = None, shared: dict[Any, Any] | None = None,
) -> CompiledForward:
    """Compile `module`'s forward in place (see [Note: compiled units]); returns the new
    `module.forward` (the existing one if it is compiled already). A forward set on the instance
    (a patched forward) is compiled as it is, for that module alone.

    Args:
        module: the module (a unit's, or any module whose hooks must stay eager).
        backend: torch.compile's backend.
        options: the other torch.compile keyword arguments (mode, dynamic, options, ...).
        fullgraph: None: one graph unless the module holds an eager region or breaks (then
            with breaks, recorded); True or False: passed on as given.
        label: how messages name the module (default: its class).
        shared: a dict to pass to every call that compiles modules together (one
            `engine.compile()`): modules of one class then share one compilation, so one
            fullgraph decision and one report.
    """
    options = dict(options or {})
    if isinstance(module.__dict__.get("forward"), CompiledForward):
        return module.__dict__["forward"]
    prepare_eager_regions()
    original = module.__dict__.get("forward")
    has_eager = bool(eager_parts(module))
    label = label or type(module).__qualname__
    if original is not None:
        compilation = _Compilation(original, label, backend, options, fullgraph, has_eager)
    else:
        shared = {} if shared is None else shared
        key = (type(module), has_eager)
        compilation = shared.get(key)
        if compilation is None:
            compilation = _Compilation(type(module).forward, label, backend, options, fullgraph, has_eager)
            shared[key] = compilation
    compiled = CompiledForward(module, compilation, bound=original is not None, original=original)
    module.forward = compiled
    return compiled
