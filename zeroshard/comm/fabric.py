"""An alpha-beta model of a fabric: how long a collective would take on a link that does not exist.

[Note: the fabric model]
A simulated world (zeroshard/comm/simulated.py) moves no data. With a fabric, each collective
instead takes the time this model gives it, as a timed wait on the stream it would have run
on, so that the engine's own prefetch, bucket and stream schedule decides how much of it is
hidden behind compute. The model is the textbook ring model, with the two numbers NCCL's own
tests report (nccl-tests' "bus bandwidth", which is the same for every collective kind):

    S   bytes of the collective's buffer, as the recorder counts it (zeroshard/comm/collectives.py:
        the full, unsharded buffer of an all-gather or reduce-scatter; the tensor of an
        all-reduce or broadcast; what this rank sends in an all-to-all)
    n   ranks in the group
    B   bus bandwidth (bytes/s), a   latency of one ring step (s)

    all_gather, reduce_scatter:  t = (n - 1) * a + S * (n - 1) / n / B
    all_to_all:                  t = (n - 1) * a + S * (n - 1) / n / B
    all_reduce:                  t = 2 (n - 1) * a + 2 S * (n - 1) / n / B
    broadcast:                   t = (n - 1) * a + S / B
    barrier:                     t = 2 (n - 1) * a

and t = 0 on a group of one. What it leaves out: the algorithm NCCL picks (trees and PAT have
logarithmic latency, so at hundreds of ranks the ring's (n - 1) * a overstates the latency of
small collectives), congestion, two-level (NVLink inside a node, network across) topologies
(a fabric here is one level: every rank reaches every other at B), and the SMs a real
collective's kernel takes from compute. docs/simulate.md states the same.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = ["Fabric", "PRESETS", "parse_fabric", "KINDS"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier")


@dataclass(frozen=True)
class Fabric:
    """One level of links: every rank reaches every other at `bus_gbps`.

    Attributes:
        name: what reports call it ("nvlink", "ib", or the user's NAME).
        bus_gbps: bus bandwidth in GB/s (10^9 bytes per second), nccl-tests' busbw.
        latency_us: latency of one ring step in microseconds.
    """

    name: str
    bus_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bus_gbps) and self.bus_gbps > 0):
            raise ValueError(f"fabric {self.name!r}: bandwidth {self.bus_gbps} GB/s must be a positive number.")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"fabric {self.name!r}: latency {self.latency_us} us must be a number >= 0.")

    def seconds(self, kind: str, nbytes: int, group_size: int) -> float:
        """Modelled duration of one collective (the formulas of [Note: the fabric model])."""
        n = int(group_size)
        if n <= 1:
            return 0.0
        bandwidth = self.bus_gbps * 1e9
        step = self.latency_us * 1e-6
        share = (n - 1) / n
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return (n - 1) * step + nbytes * share / bandwidth
        if kind == "all_reduce":
            return 2 * (n - 1) * step + 2 * nbytes * share / bandwidth
        if kind == "broadcast":
            return (n - 1) * step + nbytes / bandwidth
        if kind == "barrier":
            return 2 * (n - 1) * step
        raise ValueError(f"collective kind {kind!r}: the fabric model knows {', '.join(KINDS)}.")

    def describe(self) -> dict:
        return {"name": self.name, "bus_gbps": self.bus_gbps, "latency_us": self.latency_us}


# Both one level, as the model is (see the note). Bandwidths are about 80% of the link's rate
# per direction, what nccl-tests reaches on large buffers:
#   nvlink: NVLink 4 (H100/H200), 450 GB/s per direction per GPU; an NVLink domain as large as
#           the group (an NVL72-class rack, or a whole node at W <= 8).
#   ib:     one 400 Gb/s (NDR) InfiniBand port per GPU, 50 GB/s per direction.
PRESETS: dict[str, Fabric] = {
    "nvlink": Fabric("nvlink", bus_gbps=360.0, latency_us=3.0),
    "ib": Fabric("ib", bus_gbps=40.0, latency_us=10.0),
}

_CUSTOM = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)=(?P<gbps>[^,]+),(?P<lat>[^,]+)$")


def parse_fabric(text: str) -> Fabric:
    """A fabric from `--fabric`: a preset name, or NAME=GBps,latency_us (e.g. "roce=25,12")."""
    text = text.strip()
    if text in PRESETS:
        return PRESETS[text]
    match = _CUSTOM.match(text)
    if match is None:
        raise ValueError(
            f"--fabric={text!r}: not a preset ({', '.join(PRESETS)}) nor NAME=GBps,latency_us. "
            "Write e.g. --fabric nvlink, or --fabric roce=25,12 for 25 GB/s and 12 us per step."
        )
    try:
        gbps, latency = float(match["gbps"]), float(match["lat"])
    except ValueError:
        raise ValueError(
            f"--fabric={text!r}: bandwidth and latency must be numbers (GB/s, microseconds). "
            "Write e.g. --fabric roce=25,12."
        ) from None
    try:
        return Fabric(match["name"], gbps, latency)
    except ValueError as exc:
        raise ValueError(f"--fabric={text!r}: {exc} Write e.g. --fabric roce=25,12.") from None
