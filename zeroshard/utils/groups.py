"""DeepSpeed's `deepspeed.utils.groups` path: read-only views onto the parallel layout
(re-exports of `zeroshard.groups`). DeepSpeed names most of these with a leading
underscore; users and libraries call them by those names."""

from zeroshard.groups import *  # noqa: F403  (every name of zeroshard.groups.__all__, underscored ones too)
from zeroshard.groups import __all__  # noqa: F401
