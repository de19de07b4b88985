"""`zeroshard.comm`: DeepSpeed's `deepspeed.comm` path.

The engine's own collectives (every collective it issues, each naming its group, and the
recorder) live in `zeroshard.comm.collectives`; this package re-exports them for users
(`zeroshard.comm.recording()`)."""

from zeroshard.comm.collectives import *  # noqa: F401,F403
from zeroshard.comm.collectives import __all__ as _collectives_all

__all__ = list(_collectives_all)
