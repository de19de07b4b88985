"""DeepSpeed's `ZeroParamStatus`: whether a stage-3 parameter's full data is present.

TRL and other integrations compare a parameter's `ds_status` with these members before
gathering (`p.ds_status != ZeroParamStatus.AVAILABLE`); the values are DeepSpeed 0.19's.
"""

from __future__ import annotations

import enum


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # the full parameter is in memory (gathered, or never partitioned)
    NOT_AVAILABLE = 2  # only this rank's partition is
    INFLIGHT = 3  # a gather is under way
