"""The one resolve pass: a raw DeepSpeed-style config in, the frozen, resolved config out
(`resolve_config`, rules.py). It sits above the components whose rules it runs (the precision
plan, the optimizers and schedules, the stage policy), so that the schema in zeroshard/config
stays a leaf (docs/design.md, "The floors")."""

from zeroshard.resolve.rules import group_size_problems, resolve_config

__all__ = ["resolve_config", "group_size_problems"]
