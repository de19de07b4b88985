"""``compile``: DeepSpeed's section for `engine.compile()` (docs/compile.md).

DeepSpeed 0.19.8's `CompileConfig` holds one key for plain torch.compile, ``autoep_non_moe``
(compile the modules around AutoEP layers and keep the layers eager), and the switches of
DeepCompile, its compiler that rewrites ZeRO's gathers and reductions into the graph with
passes of its own. zeroshard compiles each unit with torch.compile and keeps its gathers, hooks
and reductions outside the graphs, so it honours ``autoep_non_moe`` and refuses every DeepCompile
switch set to ask for something; at DeepSpeed's default value a switch asks for nothing and is
accepted with no effect. As in DeepSpeed, the section configures `engine.compile()`; it compiles
nothing by itself.
"""

from __future__ import annotations

from typing import ClassVar

from zeroshard.config.base import _empty, _equals, _Section, _Unsupported

__all__ = ["DEEPCOMPILE_KEYS", "CompileConfig"]

_DEEPCOMPILE = (
    "A DeepCompile option: zeroshard has no DeepCompile (DeepSpeed's graph passes that move ZeRO's gathers and "
    "reductions into the compiled graph); engine.compile() compiles each unit with torch.compile and keeps them "
    "outside (docs/compile.md). Remove it."
)

# DeepSpeed 0.19.8's DeepCompile keys and the value of each that asks for nothing (its default).
DEEPCOMPILE_KEYS: dict[str, object] = {
    "free_activation": False,
    "free_activation_threshold": 10 * 1024 * 1024,
    "offload_activation": False,
    "offload_activation_pin_memory": True,
    "offload_opt_states": False,
    "double_buffer": True,
    "symmetric_memory": False,
    "debug_log": False,
    "offload_parameters": False,
    "sync_before_reduce": False,
    "sync_after_reduce": False,
    "sync_before_allgather": False,
    "sync_after_allgather": False,
    "keep_int_input_tensors": True,
    "keep_all_input_tensors": False,
}


class CompileConfig(_Section):
    """``compile``.

    Attributes:
        autoep_non_moe: `engine.compile()` compiles only the modules that hold an AutoEP layer
            (each layer's parent), with ``fullgraph=False`` and ``dynamic=False``, and runs the
            AutoEP layers eagerly, as DeepSpeed does; it needs AutoEP layers
            (``expert_parallel.enabled``). False: every unit is compiled (zeroshard's default;
            AutoEP and MoE layers run eagerly inside them either way).
    """

    autoep_non_moe: bool = False

    NOT_SUPPORTED: ClassVar[dict[str, _Unsupported]] = {
        "deepcompile": _Unsupported(
            _equals(False),
            "DeepCompile (DeepSpeed's compiler that rewrites ZeRO's gathers and reductions into the graph) is not "
            "implemented; engine.compile() compiles each unit with torch.compile (docs/compile.md). Set false or "
            "remove it.",
        ),
        "passes": _Unsupported(
            _empty,
            "DeepCompile's graph passes (z1, z3, autosp, autotp) are not implemented: zeroshard's stages and "
            "sequence parallelism run with or without engine.compile(). Remove it.",
        ),
        **{key: _Unsupported(_equals(inert), _DEEPCOMPILE) for key, inert in DEEPCOMPILE_KEYS.items()},
    }
