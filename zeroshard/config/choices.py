"""Values the config accepts whose meaning lives in a component, named here so that the
schema imports no component (zeroshard/config is a leaf; the component rules run in the one
resolve pass, zeroshard/resolve/rules.py). tests/unit/config/test_config_leaf.py checks each
list against its component."""

from __future__ import annotations

# The default of zeroshard.collective_timeout_s: long enough for a first step's warm-up or a
# large checkpoint written by one rank while the others wait, short enough that a frozen peer
# is an error a user sees in minutes instead of torch's 30-minute default.
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0

# `scheduler.type`: the schedules of zeroshard.optim.schedulers.SCHEDULERS, in its order.
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")

# `expert_parallel.preset_model`: the families of zeroshard.moe.autoep.presets.PRESETS, in its order.
AUTOEP_PRESETS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")
