"""The only caller of torch.distributed collectives, and the collective recorder.

Every collective the engine issues goes through one of the functions below, so that
`recording()` sees all of them with the dtype that actually went on the wire and the group
they ran on. Each takes its `Group` explicitly (zeroshard/sharding/layout.py decides which): nothing
reaches the default process group implicitly. On a group of one rank (a world of 1, or a
layout without replication) the collectives are the identity and nothing is recorded: no
bytes cross a wire.

A collective that fails or times out (`set_timeout`, zeroshard.collective_timeout_s) raises
`zeroshard.comm.faults.CollectiveError` naming the collective, its group, and the step and unit it
belonged to (zeroshard/comm/faults.py's note), on the blocking call or on the handle's `wait()`.

Each collective is also noted in the progress record and waited for there
([Note: the progress record] in zeroshard/comm/progress.py), and on gloo it runs on the channel
of the engine call it belongs to ([Note: one transport per phase] in zeroshard/comm/channels.py):
when the ranks stop moving together, the watchdog (zeroshard/comm/watchdog.py) names where each
one is and every waiting rank raises `faults.HangError` with that diagnosis.
"""

from __future__ import annotations

import contextlib
import pickle
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zeroshard.comm import channels, faults, progress, simulated
from zeroshard.comm import compat as _compat

__all__ = [
    "Group",
    "world_group",
    "self_group",
    "new_group",
    "all_gather_object",
    "CollectiveRecord",
    "CollectiveLog",
    "recording",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "all_to_all_single",
    "group_of",
    "as_group",
    "new_process_group",
    "world_size",
    "rank",
    "backend_name",
    "set_timeout",
    "open_channels",
    "open_gather_channels",
]

_FLOAT8 = frozenset(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
_timeout_s: float | None = None  # what set_timeout last applied (named in errors)


def set_timeout(group: Group, seconds: float) -> None:
    """Make `seconds` the timeout of `group`'s collectives (a group this process already has)."""
    global _timeout_s
    _timeout_s = seconds
    # A simulated group never waits for a peer (zeroshard/comm/simulated.py): no timeout to set.
    if group.handle is not None and not simulated.is_simulated(group.handle):
        timeout = timedelta(seconds=seconds)
        _compat.set_group_timeout(group.handle, timeout)
        channels.set_timeout(group.ranks, timeout, _compat.set_group_timeout)


def open_channels(group: Group, timeout_s: float | None = None) -> None:
    """Give `group` its phase channels ([Note: one transport per phase] in
    zeroshard/comm/channels.py) if it has none yet; collective over its members. gloo only."""
    if group.rank >= 0 and group.size > 1:
        channels.open_channels(group.ranks, group.handle, timeout_s, progress.state.join_channel)


def open_gather_channels(group: Group, sizes: list[tuple[int, torch.dtype]], timeout_s: float | None = None) -> None:
    """A channel for each stage-3 gather size (elements per rank, wire dtype) over `group`;
    collective over its members, who pass the same sizes. gloo only."""
    if group.rank >= 0 and group.size > 1:
        channels.open_gather_channels(group.ranks, group.handle, sizes, timeout_s, progress.state.join_channel)


def _failure(what: str, exc: BaseException) -> faults.CollectiveError:
    if isinstance(exc, faults.HangError):  # the watchdog's diagnosis, raised from the wait
        return faults.HangError(f"{what} did not complete: the hang watchdog stopped it.", exc.diagnosis)
    limit = f"zeroshard.collective_timeout_s={_timeout_s:g}" if _timeout_s is not None else "the group's timeout"
    text = (
        f"{what} did not complete: {type(exc).__name__}: {exc}. A peer rank stopped, died or is running "
        f"other collectives ({limit} elapsed, or its connection closed); every rank must make the same "
        "engine calls in the same order."
    )
    # The watchdog, when it runs, names which rank failed and where the others are.
    diagnosis = progress.state.diagnose_failure(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    if diagnosis is not None:
        return faults.HangError(f"{what} did not complete: {type(exc).__name__}: {exc}", diagnosis)
    return faults.CollectiveError(text)


def _describe(op: str, tag: str, group: Group) -> str:
    return f"{op} '{tag}' over ranks {list(group.ranks)} at {faults.where.describe()}"


class _Pending:
    """A collective's handle whose `wait()` names the collective if it fails."""

    def __init__(self, work, what: str, entry: progress.Entry | None, sliced: bool, then=None) -> None:
        self._work, self._what, self._entry, self._sliced, self._then = work, what, entry, sliced, then

    def wait(self) -> bool:
        try:
            progress.wait(self._work, self._entry, self._sliced)
        except Exception as exc:
            raise _failure(self._what, exc) from exc
        if self._then is not None:
            self._then()
        return True


def _issue(name: str, tensor: torch.Tensor, wire_numel: int, numel: int | None, tag: str, group: Group, fn,
           /, *args, async_op: bool, then=None, **kwargs):
    """Note, route and issue one collective `name` (`fn(*args, group=..., async_op=True, **kwargs)`);
    an asynchronous one comes back as a `_Pending` (whose `wait()` then runs `then`), a
    blocking one is waited for here. `wire_numel`: this rank's input elements (the channel of a
    gather), `numel`: the progress record's (None where ranks legitimately differ)."""
    what = _describe(name, tag, group)
    if progress.state.enabled:
        route = channels.route(
            group.ranks, group.handle, progress.state.channel_call(), name, tag, wire_numel, tensor.dtype
        )
        entry = progress.state.issued(
            name, tensor.dtype, numel, tag, channels.group_key(group.ranks), group.size, route.channel
        )
    else:  # progress.bypassed(): as before the progress record
        route, entry = channels.Route(group.handle, "", False), None
    try:
        work = fn(*args, group=route.handle, async_op=True, **kwargs)
    except Exception as exc:
        raise _failure(what, exc) from exc
    pending = _Pending(work, what, entry, route.sliced, then)
    if async_op:
        return pending
    pending.wait()
    return None


@dataclass(frozen=True, eq=False)
class Group:
    """A process group named by its global ranks.

    Attributes:
        ranks: the members' global ranks, in group-rank order.
        rank: this process's index in `ranks` (its group rank).
        handle_ref: a weak reference to torch's process group; None for a group of one made by
            `new_group` (a group of one never communicates, whatever its handle). Weak so that
            an engine alive at exit does not keep the group, and its gloo threads, alive past
            destroy_process_group ([Note: process-group lifetime] in zeroshard/launch/distributed.py).
    """

    ranks: tuple[int, ...]
    rank: int
    handle_ref: Callable[[], object] | None = None

    @property
    def handle(self) -> object:
        """torch's process group; None for a group of one (no communication)."""
        if self.handle_ref is None:
            return None
        handle = self.handle_ref()
        if handle is None:
            raise RuntimeError(
                f"{self!r}: its process group was destroyed (destroy_process_group). Use the engine "
                "only while its process group exists."
            )
        return handle

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks}, rank={self.rank})"


def world_group() -> Group:
    """Every rank (the default process group, named explicitly)."""
    initialized = dist.is_available() and dist.is_initialized()
    return Group(tuple(range(world_size())), rank(), _weak(dist.group.WORLD) if initialized else None)


def _weak(handle: object) -> Callable[[], object] | None:
    if handle is None:
        return None
    try:
        return weakref.ref(handle)
    except TypeError:  # torch's marker for a group this rank is not in (not a group object)
        return lambda: handle


def self_group(world: Group) -> Group:
    """This rank alone: a group whose collectives are the identity."""
    return Group((world.ranks[world.rank],), 0, None)


def new_group(members: tuple[int, ...], world: Group, timeout_s: float | None = None) -> Group:
    """A group of `members` (global ranks) whose collectives time out after `timeout_s`
    (torch's default when None). Collective over `world` when it has more than one member:
    every rank must create every group, in the same order (torch's rule)."""
    members = tuple(members)
    mine = world.ranks[world.rank]
    timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
    handle = dist.new_group(list(members), timeout=timeout) if len(members) > 1 else None
    group = Group(members, members.index(mine) if mine in members else -1, _weak(handle))
    # Its channels now, while every rank creates its groups in the same order.
    open_channels(group, timeout_s)
    return group


def backend_name(group: Group) -> str:
    """The backend `group`'s collectives run on ("nccl", "gloo", ...); "" for a group of one
    (no collective runs). A simulated group answers for the backend it stands in for, "nccl"
    on CUDA and "gloo" on the CPU (zeroshard/comm/simulated.py), so the engine makes the choices
    it would make on real ranks (bucket sizes, gloo's reduce-scatter as an all-reduce)."""
    if group.handle is None:
        return ""
    emulated = simulated.emulated_backend(group.handle)
    return emulated if emulated is not None else str(dist.get_backend(group.handle))


def _check(group: Group) -> Group:
    assert isinstance(group, Group), f"a collective needs an explicit zeroshard.comm.Group, got {group!r}"
    return group


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective as it went on the wire.

    Attributes:
        op: "all_reduce", "reduce_scatter", "all_gather", "broadcast" or "all_to_all".
        dtype: the dtype of the tensors sent.
        numel: elements of the full, unsharded buffer (the reduce-scatter input, the
            all-gather output).
        bytes: numel times the element size.
        tag: what the engine used it for ("grad", "param", "norm", "overflow", ...).
        via: the collective that carried it out when that is another one (on gloo a
            reduce-scatter runs as an all-reduce, see `reduce_scatter`); "" otherwise.
        group: the global ranks of the group it ran on.
    """

    op: str
    dtype: torch.dtype
    numel: int
    bytes: int
    tag: str = ""
    via: str = ""
    group: tuple[int, ...] = ()


class CollectiveLog:
    """What `recording()` yields: `records` grows while the block runs.

    A log whose `timed` is true is also told each collective's duration (`add_duration`):
    zeroshard/monitor/comms.py's `comms_logger`.
    """

    timed = False

    def __init__(self) -> None:
        self.records: list[CollectiveRecord] = []

    def add_duration(self, record: CollectiveRecord, start: object, end: object) -> None:
        """`record` ran from `start` to `end`: `time.perf_counter()` values, or on CUDA two
        events on the issuing stream (read later, so timing adds no host synchronisation)."""

    def total_bytes(self, op: str | None = None, tag: str | None = None) -> int:
        return sum(
            r.bytes
            for r in self.records
            if (op is None or r.op == op) and (tag is None or r.tag == tag)
        )


_active_logs: list[CollectiveLog] = []


@contextlib.contextmanager
def recording() -> Iterator[CollectiveLog]:
    """Record every collective the engine issues inside the block.

    Example:
        with zeroshard.comm.recording() as log:
            engine.backward(engine(batch)); engine.step()
        print({(r.op, r.dtype) for r in log.records})
    """
    log = CollectiveLog()
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


def _mark(device: torch.device) -> object:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _record(
    op: str, tensor: torch.Tensor, numel: int, tag: str, group: Group, via: str = ""
) -> Callable[[], None] | None:
    """Record the collective about to be issued; returns what to call once it completed
    (None when no log times collectives)."""
    if not _active_logs:
        return None
    rec = CollectiveRecord(op, tensor.dtype, numel, numel * tensor.element_size(), tag, via, group.ranks)
    for log in _active_logs:
        log.records.append(rec)
    timed = [log for log in _active_logs if log.timed]
    if not timed:
        return None
    device = tensor.device
    start = _mark(device)

    def done() -> None:
        end = _mark(device)
        for log in timed:
            log.add_duration(rec, start, end)

    return done


def _chain(first: Callable[[], object] | None, then: Callable[[], None] | None):
    """`first`, then `then` (either may be None)."""
    if first is None or then is None:
        return first or then
    return lambda: (first(), then())


def world_size() -> int:
    """Ranks in the world (1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank()


def all_reduce(
    tensor: torch.Tensor, *, group: Group, op=dist.ReduceOp.SUM, tag: str = "", async_op: bool = False
):
    """In-place all-reduce of `tensor` over `group` (summed unless `op` says otherwise).

    Returns `tensor`, or with `async_op` a handle to `wait()` on (None if nothing to wait for).
    """
    if _check(group).size == 1:
        return None if async_op else tensor
    done = _record("all_reduce", tensor, tensor.numel(), tag, group)
    work = _issue("all_reduce", tensor, tensor.numel(), tensor.numel(), tag, group, dist.all_reduce, tensor, op=op,
                  async_op=async_op, then=done)
    return work if async_op else tensor


def _reduce_scatter_runs_as_all_reduce(group: Group) -> bool:
    """On gloo an all-reduce of the whole buffer beats its reduce-scatter: the reduce-scatter
    took 1.1-2.4x as long at 0.2-10 M elements on 2 ranks (benchmarks/collectives.py,
    docs/benchmarks.md).
    NCCL's reduce-scatter moves half the bytes of its all-reduce, so it is used there."""
    return backend_name(group) == "gloo"


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, *, group: Group, tag: str = "", async_op: bool = False
):
    """Sum `input` (group size x len(output) elements) over `group`; keep this rank's chunk.

    `input` is scratch: on gloo the sum is an all-reduce in place in `input` (faster there,
    see `_reduce_scatter_runs_as_all_reduce`), so its contents afterwards are unspecified.
    Returns `output`, or with `async_op` a handle to `wait()` on (None if nothing to wait for).
    """
    ws = _check(group).size
    if ws == 1:
        output.copy_(input.view(-1))
        return None if async_op else output
    assert input.numel() == output.numel() * ws, "reduce_scatter sizes disagree"
    n = input.numel()
    if _reduce_scatter_runs_as_all_reduce(group):
        done = _record("reduce_scatter", input, n, tag, group, via="all_reduce")
        flat_input = input.view(-1)
        mine = flat_input.view(ws, -1)[group.rank]
        # The handle's wait() also copies this rank's chunk where the caller wants it.
        work = _issue("reduce_scatter", input, n, n, tag, group, dist.all_reduce, flat_input, async_op=async_op,
                      then=_chain(lambda: output.copy_(mine), done))
        return work if async_op else output
    done = _record("reduce_scatter", input, n, tag, group)
    work = _issue("reduce_scatter", input, n, n, tag, group, _compat.reduce_scatter_single, output, input.view(-1),
                  async_op=async_op, then=done)
    return work if async_op else output


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group: Group, tag: str = "", async_op: bool = False
):
    """Concatenate every group member's `input` into `output` (group size x len(input) elements).

    Returns `output`, or with `async_op` a handle whose `wait()` must be called before
    `output` is read (None when there was nothing to wait for).
    """
    ws = _check(group).size
    if ws == 1:
        output.view(-1).copy_(input.view(-1))
        return None if async_op else output
    assert output.numel() == input.numel() * ws, "all_gather sizes disagree"
    done = _record("all_gather", input, output.numel(), tag, group)
    wire_in, wire_out = input, output
    if input.dtype in _FLOAT8:
        # An all-gather copies bytes: fp8 travels as its uint8 view (gloo has no fp8 type); the
        # recorder, the progress record and the gather's channel see the fp8 dtype on the wire.
        wire_out, wire_in = output.view(torch.uint8), input.view(torch.uint8)
    work = _issue("all_gather", input, input.numel(), output.numel(), tag, group, _compat.all_gather_single,
                  wire_out.view(-1), wire_in.view(-1), async_op=async_op, then=done)
    return work if async_op else output


def broadcast(tensor: torch.Tensor, *, group: Group, src: int, tag: str = "") -> torch.Tensor:
    """`tensor` from global rank `src` (a member of `group`) to every member, in place."""
    if _check(group).size == 1:
        return tensor
    done = _record("broadcast", tensor, tensor.numel(), tag, group)
    _issue("broadcast", tensor, tensor.numel(), tensor.numel(), tag, group, dist.broadcast, tensor, src=src,
           async_op=False, then=done)
    return tensor


def _control_device(group: Group) -> torch.device:
    """Where a control message's bytes travel: the current GPU on NCCL (its tensors must be
    on one), the host elsewhere."""
    if "nccl" in str(dist.get_backend(group.handle)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: object, *, group: Group) -> list[object]:
    """`obj` from every member of `group`, in group-rank order (control messages such as
    checkpoint outcomes; pickled, not recorded: no tensor dtype goes on the wire).

    torch's `all_gather_object` waits inside itself, where the watchdog could not reach it; this
    is the same exchange (the pickles' lengths, then the pickles padded to the longest) made of
    two all-gathers that wait like the others."""
    if _check(group).size == 1:
        return [obj]
    payload = pickle.dumps(obj)
    device = _control_device(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty(group.size, dtype=torch.int64, device=device)
    _issue("all_gather_object", length, 1, None, "control", group, _compat.all_gather_single, lengths, length,
           async_op=False)
    sizes = lengths.tolist()
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    everyone = torch.empty(group.size * max(sizes), dtype=torch.uint8, device=device)
    _issue("all_gather_object", mine, mine.numel(), None, "control", group, _compat.all_gather_single, everyone,
           mine.to(device), async_op=False)
    rows = everyone.view(group.size, -1).cpu()
    return [pickle.loads(rows[i, :n].numpy().tobytes()) for i, n in enumerate(sizes)]


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    *,
    group: Group,
    tag: str = "",
    async_op: bool = False,
):
    """Send the i-th slice of `input` (along dim 0) to group rank i; slice j of `output` is what
    group rank j sent. Equal slices when the split sizes are None, as torch's function.

    Returns `output`, or with `async_op` a handle whose `wait()` must be called before `output`
    is read (None if nothing to wait for). Recorded with the elements this rank sends. On a
    group of one, `output` is a copy of `input`.
    """
    if _check(group).size == 1:
        output.copy_(input)
        return None if async_op else output
    done = _record("all_to_all", input, input.numel(), tag, group)
    # Rows per rank may differ between ranks (uneven splits): the record keeps no element count.
    work = _issue("all_to_all", input, input.numel(), None, tag, group, dist.all_to_all_single, output,
                  input.contiguous(), output_split_sizes, input_split_sizes, async_op=async_op, then=done)
    return work if async_op else output


def group_of(handle: object) -> Group:
    """A `Group` for a torch process group a caller holds (DeepSpeed code passes those as
    `ep_group`); a handle of one rank becomes a group without communication."""
    ranks = tuple(dist.get_process_group_ranks(handle))
    return Group(ranks, ranks.index(rank()), _weak(handle) if len(ranks) > 1 else None)


def as_group(group: Group | dist.ProcessGroup) -> Group:
    """A `Group` for what users hand to DeepSpeed-style APIs (`DistributedAttention`, an mpu's
    groups): a `Group` as is, or a torch ProcessGroup named by its global ranks."""
    if isinstance(group, Group):
        return group
    return Group(tuple(dist.get_process_group_ranks(group)), dist.get_rank(group), _weak(group))


def new_process_group(members: tuple[int, ...], world: Group) -> Group:
    """As `new_group`, but with a torch ProcessGroup handle even for one member: for groups
    handed to users' code (an mpu's getters), where a None handle would mean the default group
    to torch. Collective over `world`: every rank creates every group, in the same order."""
    members = tuple(members)
    mine = world.ranks[world.rank]
    handle = dist.new_group(list(members))
    return Group(members, members.index(mine) if mine in members else -1, _weak(handle))
