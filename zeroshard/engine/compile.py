"""`engine.compile()`: torch.compile unit by unit, with DeepSpeed 0.19.8's signature.

Each unit's module is compiled in place ([Note: compiled units] in
zeroshard/engine/compiled_forward.py): its forward is one graph where it can be, and the
engine's gathers, frees, hooks and reductions stay outside the graphs. The root unit's module
calls the blocks, so it stays eager when there are blocks (as in torchtitan); a model that is a
single unit is compiled whole. MoE, AutoEP and Ulysses layers run eagerly inside their unit
([Note: eager regions] in zeroshard/comm/eager_regions.py). With Muon, its Newton-Schulz
iteration is compiled too. The Hugging Face Trainer's `torch_compile=True` arrives here through
Accelerate (`engine.compile(backend=..., compile_kwargs=...)`). docs/compile.md is the user's
page.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from zeroshard.engine.compiled_forward import (
    CompiledForward,
    RegionReport,
    compile_forward,
    eager_parts,
    is_compiled_module,
)

logger = logging.getLogger("zeroshard")

# torch.compile's keyword arguments besides the function and the backend.
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options", "disable")
# Modes that record CUDA graphs, which replay fixed addresses (stage 3 frees and regathers).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _eager_rounding(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Inductor's `emulate_precision_casts` on, unless the caller set it: a fused bf16/fp16
    kernel then rounds each intermediate to the compute dtype as eager does, instead of keeping
    it in fp32, so the compute role of the precision plan (docs/design.md section 2) holds
    compiled too (measured: the first bf16 loss 1e-3 away from eager without it, within the
    conformance tolerance of 1e-5 with it; benchmarks/compile_conformance.py). torch.compile
    takes `mode` or `options`, not both: a mode becomes its options."""
    options = dict(kwargs.get("options") or {})
    if "emulate_precision_casts" in options:
        return kwargs
    kwargs = dict(kwargs)
    if "mode" in kwargs:
        from torch._inductor import list_mode_options

        options = {**list_mode_options(kwargs.pop("mode")), **options}
    options["emulate_precision_casts"] = True
    kwargs["options"] = options
    return kwargs


class CompileMixin:
    """DeepSpeed's `compile()`, `is_compiled`, and `compiled_regions`; expects the attributes
    `Engine` sets (module, units, config, optimizer)."""

    _compiled: list[tuple[str, nn.Module]] | None = None  # None: compile() not called yet

    def compile(
        self,
        backend: Any = "inductor",
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """Compile the model unit by unit with torch.compile (`backend`, `compile_kwargs`).

        DeepSpeed's signature and defaults (inductor). `compile_kwargs` takes torch.compile's
        `fullgraph`, `dynamic`, `mode`, `options`, `disable`; a `backend` in it is overridden by
        the argument, as in DeepSpeed. Without `fullgraph`, each unit is one graph where it can
        be and compiled with graph breaks where it cannot (`compiled_regions` says where). A
        second call changes nothing. The config's `compile.autoep_non_moe` compiles only the
        modules around AutoEP layers, as DeepSpeed does.

        Raises:
            ValueError: a DeepCompile `schedule`; `compiled_autograd_enabled=True`; an unknown
                keyword in `compile_kwargs`; CUDA-graph modes at stage 3; `autoep_non_moe`
                without AutoEP layers or with fullgraph/dynamic True.
        """
        kwargs = dict(compile_kwargs or {})
        if schedule is not None:
            raise ValueError(
                f"engine.compile(schedule={schedule!r}): a DeepCompile schedule; zeroshard has no DeepCompile (its "
                "passes move ZeRO's gathers and reductions into the graph; here they stay outside it). Call "
                "compile() without schedule."
            )
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True): zeroshard reduces gradients from hooks as each "
                "unit's gradients are ready (Python collectives in the backward), which compiled autograd would "
                "have to trace; each unit's backward is compiled already (AOTAutograd). Leave it False."
            )
        if "backend" in kwargs:
            logger.warning("engine.compile(): the `backend` in compile_kwargs is overridden; use the backend argument.")
            kwargs.pop("backend")
        unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
        if unknown:
            raise ValueError(
                f"engine.compile(compile_kwargs={kwargs!r}): {', '.join(map(repr, unknown))} is not a torch.compile "
                f"argument. Use {', '.join(COMPILE_KWARGS)}."
            )
        if self._compiled is not None:
            logger.info("engine.compile(): already compiled; the second call changes nothing.")
            return
        self._check_cuda_graphs(kwargs)
        if backend == "inductor" and self.precision_plan.mode != "fp32":
            kwargs = _eager_rounding(kwargs)
        if kwargs.get("disable"):
            logger.warning("engine.compile(compile_kwargs={'disable': True}): torch.compile is off; nothing compiled.")
            return
        fullgraph = kwargs.pop("fullgraph", None)
        if self.config.compile.autoep_non_moe:
            targets = self._autoep_parents(fullgraph, kwargs)
            fullgraph = False
            kwargs.setdefault("dynamic", False)
        else:
            units = self.units[1:] if len(self.units) > 1 else self.units
            targets = [(unit.name if unit.module is not self.module else "", unit.module) for unit in units]
        shared: dict[Any, Any] = {}
        compiled = []
        for name, module in targets:
            if is_compiled_module(module) and not isinstance(module.__dict__.get("forward"), CompiledForward):
                logger.info("engine.compile(): %s is compiled already (by the user); left as it is.",
                            name or "the model")
                continue
            compile_forward(module, backend, kwargs, fullgraph, label=name or type(module).__qualname__,
                            shared=shared)
            compiled.append((name, module))
        self._compiled = compiled
        self._compile_newton_schulz(backend, kwargs)
        self._warn_kv_cache()
        logger.info("engine.compile(backend=%r): %d region(s) compiled.", backend, len(compiled))

    def _check_cuda_graphs(self, kwargs: dict[str, Any]) -> None:
        options = kwargs.get("options") or {}
        wants = kwargs.get("mode") in _CUDA_GRAPH_MODES or bool(options.get("triton.cudagraphs"))
        if wants and self.zero_optimization_stage() == 3:
            raise ValueError(
                f"engine.compile(compile_kwargs={kwargs!r}): CUDA graphs replay the addresses they recorded, and "
                "ZeRO stage 3 frees every unit's parameters after use and gathers them again elsewhere. Use "
                "mode='max-autotune-no-cudagraphs' or 'default', or a stage below 3."
            )

    def _autoep_parents(self, fullgraph: bool | None, kwargs: dict[str, Any]) -> list[tuple[str, nn.Module]]:
        """DeepSpeed's `compile_autoep_non_moe_regions` choice: every AutoEP layer's parent."""
        from zeroshard.moe.autoep.layer import AutoEPMoELayer

        if fullgraph:
            raise ValueError(
                "engine.compile(compile_kwargs={'fullgraph': True}): compile.autoep_non_moe=true runs the AutoEP "
                "layers eagerly, a graph break in every region. Leave fullgraph out or set it False."
            )
        if kwargs.get("dynamic"):
            raise ValueError(
                "engine.compile(compile_kwargs={'dynamic': True}): compile.autoep_non_moe=true compiles with "
                "dynamic=False, as DeepSpeed does. Leave dynamic out or set it False."
            )
        named = dict(self.module.named_modules())
        layers = [name for name, m in named.items() if isinstance(m, AutoEPMoELayer)]
        if not layers:
            raise ValueError(
                "compile.autoep_non_moe=true: compiles the modules around AutoEP layers, and the model has none. "
                "Enable AutoEP (expert_parallel.enabled) or remove compile.autoep_non_moe."
            )
        parents: dict[str, nn.Module] = {}
        for name in layers:
            if not name:
                raise ValueError(
                    "compile.autoep_non_moe=true: the model itself is an AutoEP layer; there is nothing around it "
                    "to compile. Remove compile.autoep_non_moe."
                )
            parent_name = name.rpartition(".")[0]
            parent = named[parent_name]
            if type(parent).forward is nn.Module.forward:
                raise ValueError(
                    f"compile.autoep_non_moe=true: '{parent_name}', the parent of AutoEP layer '{name}', has no "
                    "forward of its own to compile. Compile without compile.autoep_non_moe."
                )
            parents.setdefault(parent_name, parent)
        return list(parents.items())

    def _compile_newton_schulz(self, backend: Any, kwargs: dict[str, Any]) -> None:
        compile_ns = getattr(self.optimizer, "compile_newton_schulz", None)
        if compile_ns is not None:
            compile_ns(backend, **{k: kwargs[k] for k in ("mode", "options") if k in kwargs})

    def _warn_kv_cache(self) -> None:
        config = getattr(self.module, "config", None)
        if getattr(config, "use_cache", None) is True and self.module.training:
            logger.warning(
                "engine.compile(): the model's config has use_cache=True. A Hugging Face model then builds a KV "
                "cache in training forwards too, and each decoder layer compiles a graph of its own (dynamo guards "
                "on the cache's per-layer state; past 8 layers the rest run eagerly). Set "
                "model.config.use_cache = False for training."
            )

    @property
    def is_compiled(self) -> bool:
        """Whether part of the model runs compiled code: regions `compile()` compiled, or modules
        compiled by the user (`torch.compile(block)`, `block.compile()`)."""
        if self._compiled:
            return True
        return any(is_compiled_module(m) for m in self.module.modules())

    @property
    def compiled_regions(self) -> list[RegionReport]:
        """What `compile()` compiled, one report per region: its name, whether it is one graph,
        its eager parts and the first graph break (known once it has run)."""
        reports = []
        for name, module in self._compiled or []:
            forward = module.__dict__["forward"]
            parts = {".".join(p for p in (name, sub) if p): why for sub, why in eager_parts(module).items()}
            reports.append(RegionReport(
                name=name, module_class=f"{type(module).__module__}.{type(module).__qualname__}",
                fullgraph=forward.fullgraph, eager_parts=parts, graph_break=forward.graph_break,
            ))
        return reports
