"""Channels: the transports zeroshard's collectives run on, one per engine phase (gloo).

[Note: one transport per phase]
gloo pairs the k-th collective issued on a process group on every rank, whatever each rank
meant by it, and its TCP transport checks only that an incoming message fits the buffer posted
for it: a larger one throws in gloo's I/O thread and the process aborts ("Received data size
doesn't match expected size", SIGABRT, no Python error). So two ranks in different engine calls
(one in `step()`'s norm all-reduce, the other already in the next backward's reduce-scatter;
one saving a checkpoint, the other in a forward) killed both processes.

On gloo each zeroshard group therefore has sibling groups, its channels, made with it over
the same ranks: one per engine call that issues collectives (forward and evaluation, backward,
step, checkpoint), and at stage 3 one per size of parameter gather (shard elements and dtype,
at most MAX_GATHER_CHANNELS per group, declared when the engine is built). A collective runs on
the channel of the engine call it belongs to (zeroshard/comm/progress.py's phases; anything
inside an autograd graph task is "backward"), a stage-3 parameter gather in a forward or
backward on the channel of its size, anything else (initialize, user code between calls, the
user's own groups) on the group itself. Ranks that disagree on the next collective then wait on
different transports, where no byte is exchanged, instead of exchanging mismatched sizes; the
watchdog (zeroshard/comm/watchdog.py) names the deadlock within two of its ticks. Nothing is
added to a step: a channel is only another handle for the same collective.

Channels are ordinary gloo groups (`dist.new_group(..., use_local_synchronization=True)`: only
members create them, in the same order on each), registered with torch, so
`destroy_process_group` frees them with the rest ([Note: process-group lifetime] in
zeroshard/launch/distributed.py); held here weakly. They are made once per rank set and world
(later engines over the same ranks reuse them). Not on NCCL, where each would be another
communicator and its device memory, and where a mismatch is a hang (not an abort) that the
watchdog names; not on any other backend (a simulated world moves no data).
"""

from __future__ import annotations

import weakref
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "KINDS", "MAX_GATHER_CHANNELS", "Route", "open_channels", "open_gather_channels", "route",
    "group_key", "channels_of", "set_timeout", "handles",
]

# The engine call -> its channel (progress.CALLS; "init" stays on the group itself).
KINDS = {"forward": "forward", "evaluation": "forward", "backward": "backward", "step": "step",
         "save": "checkpoint", "load": "checkpoint"}
# Stage-3 parameter gathers get a channel per (elements, dtype) up to this many per group; the
# rest (sorted by size) share the phase channel. A bound on gloo groups, not a tuning knob.
MAX_GATHER_CHANNELS = 16
_GATHER_CALLS = ("forward", "evaluation", "backward")


@dataclass(frozen=True)
class Route:
    """Where a collective goes: torch's group to call, the channel's name (the progress
    record counts collectives per channel), and whether it is waited for in slices (gloo)."""

    handle: Any
    channel: str
    sliced: bool


_KEYS: dict[tuple[int, ...], str] = {}


def group_key(ranks: tuple[int, ...]) -> str:
    """A short name of a rank set: "0-3" for consecutive ranks, "0,2" for a few others, a
    hash for a large irregular set."""
    key = _KEYS.get(ranks)
    if key is None:
        if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[0] + len(ranks))):
            key = f"{ranks[0]}-{ranks[-1]}"
        elif len(ranks) <= 8:
            key = ",".join(map(str, ranks))
        else:
            key = f"{len(ranks)}r{zlib.crc32(repr(ranks).encode()) & 0xFFFFFF:06x}"
        _KEYS[ranks] = key
    return key


class _Registry:
    """The channels of every rank set, for one world (reset when the default group changes)."""

    def __init__(self) -> None:
        self.world: Callable[[], Any] | None = None
        self.phases: dict[tuple[int, ...], dict[str, Callable[[], Any]]] = {}
        self.gathers: dict[tuple[int, ...], dict[tuple[int, str], Callable[[], Any]]] = {}
        self.sliced: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def current(self) -> _Registry:
        world = dist.group.WORLD if dist.is_initialized() else None
        if world is None or self.world is None or self.world() is not world:
            self.__init__()
            if world is not None:
                self.world = weakref.ref(world)
        return self


_registry = _Registry()


def _is_gloo(handle: Any) -> bool:
    try:
        return _registry.sliced[handle]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: do not cache
        return dist.get_backend(handle) == "gloo"
    gloo = dist.get_backend(handle) == "gloo"
    _registry.sliced[handle] = gloo
    return gloo


def _new(ranks: tuple[int, ...], timeout_s: float | None) -> Callable[[], Any]:
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    handle = dist.new_group(list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)
    return weakref.ref(handle)


def open_channels(ranks: tuple[int, ...], handle: Any, timeout_s: float | None, join: Callable[[str], None]) -> None:
    """Make the phase channels of the group `handle` over `ranks` (this rank a member), once per
    rank set: collective over its members, in the same order on each (gloo only). `join(name)`
    is told each channel this rank belongs to, the group itself included on any backend (the
    progress record counts from 0)."""
    if handle is None or len(ranks) < 2:
        return
    key = group_key(ranks)
    join(f"@{key}")  # the group itself, on any backend
    if not _is_gloo(handle):
        return
    registry = _registry.current()
    phases = registry.phases.get(ranks)
    if phases is None:
        phases = registry.phases[ranks] = {kind: _new(ranks, timeout_s) for kind in sorted(set(KINDS.values()))}
    for kind in phases:
        join(f"{kind}@{key}")


def open_gather_channels(
    ranks: tuple[int, ...], handle: Any, sizes: Iterable[tuple[int, torch.dtype]], timeout_s: float | None,
    join: Callable[[str], None],
) -> None:
    """Make a channel for each stage-3 gather size (shard elements, wire dtype) of the group over
    `ranks`; collective over its members, who must pass the same sizes. gloo only."""
    if handle is None or len(ranks) < 2 or not _is_gloo(handle):
        return
    registry = _registry.current()
    known = registry.gathers.setdefault(ranks, {})
    wanted = sorted({(int(n), str(dtype).removeprefix("torch.")) for n, dtype in sizes} - set(known))
    for size in wanted[: max(0, MAX_GATHER_CHANNELS - len(known))]:
        known[size] = _new(ranks, timeout_s)
    key = group_key(ranks)
    for numel, dtype in known:
        join(f"gather:{numel}x{dtype}@{key}")


def route(group_ranks: tuple[int, ...], handle: Any, call: str | None, op: str, tag: str,
          numel: int, dtype: torch.dtype) -> Route:
    """The channel for a collective `op` of `numel` elements (the input's, per rank) issued
    during engine call `call` (None: outside the engine) on the group `handle`."""
    sliced = _is_gloo(handle)
    key = group_key(group_ranks)
    registry = _registry
    if not sliced or call is None or registry.world is None:
        return Route(handle, f"@{key}", sliced)
    if op == "all_gather" and tag == "param" and call in _GATHER_CALLS:
        gathers = registry.gathers.get(group_ranks)
        if gathers:
            dname = str(dtype).removeprefix("torch.")
            ref = gathers.get((numel, dname))
            if ref is not None and (channel := ref()) is not None:
                return Route(channel, f"gather:{numel}x{dname}@{key}", True)
    phases = registry.phases.get(group_ranks)
    kind = KINDS.get(call)
    if phases and kind is not None and (channel := phases[kind]()) is not None:
        return Route(channel, f"{kind}@{key}", True)
    return Route(handle, f"@{key}", sliced)


def channels_of(ranks: tuple[int, ...]) -> list[Any]:
    """The live channel handles of the rank set."""
    registry = _registry
    refs = list(registry.phases.get(ranks, {}).values()) + list(registry.gathers.get(ranks, {}).values())
    return [h for h in (ref() for ref in refs) if h is not None]


def handles() -> list[Any]:
    """Every live channel handle of this world."""
    ranks = set(_registry.phases) | set(_registry.gathers)
    return [h for r in sorted(ranks) for h in channels_of(r)]


def set_timeout(ranks: tuple[int, ...], timeout: timedelta, setter: Callable[[Any, timedelta], None]) -> None:
    """Give the rank set's channels the group's new timeout (`setter(handle, timeout)`)."""
    for channel in channels_of(ranks):
        setter(channel, timeout)
