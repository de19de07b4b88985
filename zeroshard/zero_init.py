"""`zeroshard.zero.Init`: DeepSpeed's context for building a model that is sharded at stage 3.

What it does here, precisely: it is accepted with DeepSpeed's arguments, checks the config it
is given (the same one validation pass as `initialize`), and changes nothing while the model is
built: the model is constructed on the host (its default device), whole, as without it. The
sharding happens in `initialize`, which at stage 3 moves the trainable parameters to the
device flat buffer by flat buffer, sharding each before building the next (and freeing the
host copy as it goes), so the device never holds the whole model and no point holds two full
copies. Below stage 3 (and with `enabled=False`) it is a no-op in every respect.

What it does not do: materialise only each rank's shard while the module's constructor runs
(DeepSpeed patches module construction for that), so the host must hold the model once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Init"]


class Init:
    """`with zeroshard.zero.Init(config_dict_or_path=ds_config): model = MyModel()`.

    Args:
        module: an already built module (DeepSpeed converts it; here it is left as it is).
        config_dict_or_path, config: the DeepSpeed config (a dict or a JSON/HJSON path); checked
            now, so a bad config fails where the script builds its model.
        enabled: False makes the context do nothing at all.
        The other DeepSpeed arguments (data_parallel_group, remote_device, pin_memory, dtype,
        mpu, ...) are accepted and have no effect.

    Attributes:
        config: the resolved config, or None when none was given.
        stage: its ZeRO stage (None without a config).
    """

    def __init__(
        self,
        module: Any = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: Any = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: Any = None,
        mpu: Any = None,
        **kwargs: Any,
    ) -> None:
        from . import comm
        from .resolve import resolve_config

        self.enabled = enabled
        raw = config_dict_or_path if config_dict_or_path is not None else config
        self.config = resolve_config(raw, world_size=comm.world_size()) if (enabled and raw is not None) else None
        self.stage = self.config.zero_optimization.stage if self.config is not None else None

    def __enter__(self) -> Init:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        return None
