"""zeroshard: ZeRO sharded data-parallel training for PyTorch with a precision policy you can read.

`import zeroshard as deepspeed` runs a DeepSpeed-style training loop unchanged for the
supported subset of DeepSpeed's config.
"""

from __future__ import annotations

from zeroshard import comm
from zeroshard.comm.deepspeed_api import init_distributed  # DeepSpeed's: deepspeed.init_distributed is deepspeed.comm's
from zeroshard.config.error import DeepSpeedConfigError
from zeroshard.engine.initialize import initialize
from zeroshard.launch.arguments import add_config_arguments
from zeroshard.tools.deepspeed_shadow import warn_if_shadowed

__version__ = "0.1.0"

# The `deepspeed` alias, when installed, must be what `import deepspeed` finds: a warning names
# a checkout that would be imported instead (zeroshard/tools/deepspeed_shadow.py).
warn_if_shadowed()

__all__ = [
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "DeepSpeedConfigError",
    "comm",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "tp_model_init",
    "__version__",
]


# DeepSpeed's top-level names that zeroshard keeps elsewhere, imported on first use so that
# `import zeroshard` stays light: name -> (module, attribute).
_LAZY_NAMES = {
    "DeepSpeedEngine": ("zeroshard.engine.engine", "Engine"),  # the engine class, for isinstance
    "logger": ("zeroshard.monitor.log", "logger"),
    "log_dist": ("zeroshard.monitor.log", "log_dist"),
    # AutoTP: records the tensor-parallel arguments for the next initialize (DeepSpeed 0.19.8's).
    "tp_model_init": ("zeroshard.autotp.model_init", "tp_model_init"),
}


def __getattr__(name: str):
    import importlib

    if name in ("safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state"):
        from zeroshard.zero import tensor_fragment  # the functions zeroshard.utils exports

        return getattr(tensor_fragment, name)
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        return getattr(importlib.import_module(module), attribute)
    if not name.startswith("_"):
        # DeepSpeed's package has its subpackages as attributes (`deepspeed.utils.safe_get_full_grad`
        # right after `import deepspeed`); here each is imported when first read (issue 30, item 3).
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the subpackage exists but something it imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
