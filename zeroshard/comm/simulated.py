"""A simulated world: rank r of a W-rank job, run for real in one process, over a process group
whose collectives move no data.

    from zeroshard.comm import simulated
    with simulated.world(64, rank=3, fabric=parse_fabric("nvlink")) as sim:
        engine, *_ = zeroshard.initialize(model=model, config=config)   # sees 64 ranks
        ...                                                              # trains as rank 3
        sim.fabric = None                                                # collectives take no time

[Note: simulated collectives]
`world()` creates torch's default process group on a backend of zeroshard's own
(`BACKEND`), a Python `ProcessGroup` that every group of the run is made of (subgroups from
`dist.new_group` too: no gloo, no NCCL, no peer). Everything above it (the engine, FSDP2,
DeviceMesh, user code) calls torch.distributed as usual and sees W ranks.

Each collective completes without sending anything. What it leaves in its output is a stand-in
for the peers' data: every peer is taken to be a replica of this rank, holding the same
shards and sending what this rank sends. So an all-gather fills every rank's chunk with this
rank's input; a sum (all-reduce, reduce-scatter) is W times this rank's value (its chunk of
it); MAX, MIN and AVG leave it as it is; an all-to-all gives back, from every peer, the rows
this rank sent itself (cut or zero-padded to the sizes the caller expects); a broadcast
leaves this rank's tensor. Values stay finite and shapes agree across the collectives of one
exchange (the counts of an uneven all-to-all, then its tokens), which is what a run needs:
garbage in a gathered parameter (memory the allocator recycled, fp32 bytes read as bf16) would
make the loss NaN and every step a skipped one. Value checks that compare ranks (the packed
norm's agreement, the rank-desync check, naming the ranks whose gradient was not finite) have
their own stand-in where they are made (zeroshard/step/optimizer_step.py); a simulated run
writes no checkpoint (zeroshard/checkpoint/save.py).

Time. Without a fabric a collective takes no time (beyond the stand-in's local copy). With a
fabric (zeroshard/comm/fabric.py's alpha-beta model) each collective takes the modelled time
on the stream it would have run on, so the engine's prefetch, bucket and stream schedule
decides how much of it compute hides:
* CUDA: as ProcessGroupNCCL, each group has its own communication stream per device. The
  collective waits there for the issuing stream (an event), then the stand-in copy and a timed
  wait (`torch.cuda._sleep`, calibrated in cycles per second, less the copy's own time) run
  on it; a blocking collective makes the issuing stream wait for its end, an asynchronous one
  leaves that to `wait()` (on the stream current at that call), as NCCL's work does. Tensors
  are recorded on the communication stream, as NCCL records them.
* CPU: each group is a lane that runs one collective at a time; a collective issued at t
  starts when the lane is free, ends after its modelled time, and `wait()` sleeps until then
  (a blocking collective waits at once).
Collectives of one group queue behind each other (NCCL's stream per communicator does too);
different groups overlap. A collective's tensors stay referenced by its work until `wait()`,
as gloo's and NCCL's work hold them while the collective runs: a buffer its caller drops right
after issuing is freed at the same point as on real ranks (the same peak memory).

The engine asks `zeroshard.comm.collectives.backend_name` which backend runs a group, and a
simulated group answers for the one it stands in for: "nccl" on CUDA, "gloo" on the CPU. So the
engine chooses as on real ranks: the reduce bucket's default size (one unit on NCCL, DeepSpeed's
5e8 elements on gloo: zeroshard/grads/reduce.py) and, on the CPU, gloo's reduce-scatter carried
out as an all-reduce of the whole buffer (timed by the fabric as the all-reduce it is).

Why not torch's fake backend (torch.testing._internal.distributed.fake_pg): its work completes
at once in C++ (no timed wait can be placed on it), its all-reduce and all-to-all leave their
outputs unwritten (an uneven all-to-all's counts are then garbage and its token exchange
allocates garbage sizes), and its FakeStore implements no store operation (set, get, add,
wait fail). The store here is a HashStore: store calls work, on this process's keys only
(a check that waits for peers' keys must use its own stand-in under simulation, e.g.
`is_simulated()`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zeroshard.comm.fabric import Fabric

__all__ = [
    "BACKEND",
    "SimulatedWorld",
    "CollectiveTiming",
    "world",
    "current",
    "is_simulated",
    "emulated_backend",
    "SimulatedWorldError",
    "refuse_in_simulation",
]

BACKEND = "zeroshard_sim"


@dataclass
class CollectiveTiming:
    """One collective as the simulated backend saw it (every engine's: zeroshard's, FSDP2's, a
    user's): its kind, group size, dtype, bytes as zeroshard's recorder counts them (see
    zeroshard/comm/fabric.py's note) and the fabric's modelled seconds (0 without a fabric)."""

    kind: str
    group_size: int
    dtype: torch.dtype | None
    nbytes: int
    seconds: float


@dataclass
class SimulatedWorld:
    """The simulated job this process is one rank of.

    Attributes:
        world_size, rank: the job's size and this process's rank in it.
        device: "cpu" or "cuda": where the collectives' tensors live (the backend serves that
            device only, as gloo serves the CPU and NCCL the GPUs).
        fabric: the modelled fabric, or None (collectives take no time). May be changed between
            steps (a compute-only step, then one with the fabric).
        log: when a list, every collective is appended to it (`CollectiveTiming`).
    """

    world_size: int
    rank: int
    device: str = "cpu"
    fabric: Fabric | None = None
    log: list[CollectiveTiming] | None = None
    _clock: _CudaClock | None = field(default=None, repr=False)

    def seconds(self, kind: str, nbytes: int, group_size: int) -> float:
        return 0.0 if self.fabric is None else self.fabric.seconds(kind, nbytes, group_size)


_current: SimulatedWorld | None = None


def current() -> SimulatedWorld | None:
    """The simulated world this process runs in, or None (a real process group, or none)."""
    if _current is not None and not (dist.is_available() and dist.is_initialized()):
        return None
    return _current


def emulated_backend(handle: object) -> str | None:
    """For a simulated group: the backend a real run would use, "nccl" on CUDA, "gloo" on the
    CPU (zeroshard.comm.collectives.backend_name answers with it, so the engine chooses as on
    real ranks); None for any other group."""
    if not isinstance(handle, SimulatedProcessGroup):
        return None
    return "nccl" if handle._sim.device == "cuda" else "gloo"


def is_simulated(handle: object = None) -> bool:
    """Whether collectives here move no data: `handle` (a torch ProcessGroup, or a
    zeroshard.comm.Group) is a simulated group, or with None the default group is."""
    if handle is None:
        return current() is not None
    handle = getattr(handle, "handle", handle)  # a zeroshard.comm.Group
    if handle is None:
        return current() is not None  # a group of one inside a simulated world
    return isinstance(handle, SimulatedProcessGroup)


class SimulatedWorldError(RuntimeError):
    """Something a simulated rank must not do: its values are stand-ins, not training."""


def refuse_in_simulation(what: str) -> None:
    """Raise SimulatedWorldError naming `what` when this process is a simulated rank (a
    checkpoint written from stand-in values could be mistaken for a training run's)."""
    sim = current()
    if sim is not None:
        raise SimulatedWorldError(
            f"{what}: this process is rank {sim.rank} of a simulated {sim.world_size}-rank job "
            "(zeroshard simulate): its collectives moved no data and its values are stand-ins, so it writes "
            "no checkpoint or weights. Run the job on real ranks to save."
        )


@contextlib.contextmanager
def world(
    world_size: int, rank: int = 0, *, device: str = "cpu", fabric: Fabric | None = None
) -> Iterator[SimulatedWorld]:
    """Be rank `rank` of a `world_size`-rank job for the block: the default process group is
    simulated (see [Note: simulated collectives]) and destroyed at the end."""
    global _current
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: must be a positive integer.")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: must be in [0, {world_size}) for a world of {world_size}. Pick a rank in it.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: a simulated world runs on 'cpu' or 'cuda'.")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group already exists: a simulated world needs the default group to itself. "
            "Destroy it first (torch.distributed.destroy_process_group()) or simulate in a fresh process."
        )
    _register()
    sim = SimulatedWorld(world_size, rank, device, fabric)
    _current = sim
    try:
        dist.init_process_group(f"{device}:{BACKEND}", store=dist.HashStore(), rank=rank, world_size=world_size)
        yield sim
    finally:
        _current = None
        if dist.is_initialized():
            dist.destroy_process_group()


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
        _registered = True


def _create(options, backend_options) -> SimulatedProcessGroup:
    sim = _current
    if sim is None:
        raise RuntimeError(
            f"the {BACKEND!r} backend is zeroshard's simulated world: create it with "
            "zeroshard.comm.simulated.world(...), not init_process_group."
        )
    return SimulatedProcessGroup(options.group_rank, options.group_size, sim)


class _CudaClock:
    """How many `torch.cuda._sleep` cycles make a second, and how fast the device copies, on
    one device: measured once, when a fabric first times a collective there."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            torch.cuda._sleep(1000)  # load the kernel
            torch.cuda.synchronize()
            rates = []
            for cycles in (2_000_000, 10_000_000, 10_000_000):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                rates.append(cycles / (start.elapsed_time(end) / 1e3))
            self.cycles_per_s = sorted(rates)[1]
            a = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
            b = torch.empty_like(a)
            b.copy_(a)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(4):
                b.copy_(a)
            end.record()
            end.synchronize()
            self.copy_bytes_per_s = 4 * a.numel() / (start.elapsed_time(end) / 1e3)

    def cycles(self, seconds: float) -> int:
        return int(seconds * self.cycles_per_s)


class SimulatedWork(dist._Work):
    """A simulated collective's handle: `wait()` returns when its modelled time has passed (CPU)
    or makes the current stream wait for it (CUDA)."""

    def __init__(self, deadline: float = 0.0, event: object = None, tensors: list | None = None) -> None:
        super().__init__()
        self._deadline = deadline
        self._event = event
        self._tensors = tensors  # held until wait(): see the note

    def wait(self, timeout=None) -> bool:
        self._tensors = None
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
            return True
        left = self._deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return True

    def is_completed(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return time.perf_counter() >= self._deadline

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _sum_factor(op) -> bool:
    """Whether the reduction is a sum (replicas add up to W times the value). torch's options
    hold a ReduceOp object, which compares equal to the enum value (but is not one)."""
    return op is None or op == dist.ReduceOp.SUM


class SimulatedProcessGroup(dist.ProcessGroup):
    """One group of a simulated world; see [Note: simulated collectives]."""

    def __init__(self, rank: int, size: int, sim: SimulatedWorld) -> None:
        super().__init__(rank, size)
        self._rank, self._size, self._sim = rank, size, sim
        self._lane_free_at = 0.0  # CPU: when this group's previous collective ends
        self._streams: dict[int, torch.cuda.Stream] = {}  # CUDA: the group's stream per device

    # torch asks a Python group for these.
    def getBackendName(self) -> str:
        return BACKEND

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    @property
    def group_name(self) -> str:
        # DeviceMesh (FSDP2) names groups; torch sets a name on its C++ groups only.
        return dist.distributed_c10d._world.pg_names[self]

    def __repr__(self) -> str:
        return f"SimulatedProcessGroup(rank={self._rank}, size={self._size})"

    # ------------------------------------------------------------------ timing
    def _run(self, kind: str, nbytes: int, dtype, tensors: list[torch.Tensor], fill) -> SimulatedWork:
        """Run the stand-in `fill` and take the collective's modelled time (see the note)."""
        sim = self._sim
        seconds = sim.seconds(kind, nbytes, self._size)
        if sim.log is not None:
            sim.log.append(CollectiveTiming(kind, self._size, dtype, nbytes, seconds))
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        if device is None or sim.fabric is None:
            # CPU, or no fabric: the copy now; on CPU the lane keeps the modelled time.
            fill()
            if device is not None or seconds <= 0.0:
                return SimulatedWork(tensors=tensors)
            start = max(time.perf_counter(), self._lane_free_at)
            self._lane_free_at = start + seconds
            return SimulatedWork(deadline=self._lane_free_at, tensors=tensors)
        return self._run_on_stream(device, seconds, tensors, fill)

    def _run_on_stream(self, device: torch.device, seconds: float, tensors, fill) -> SimulatedWork:
        sim = self._sim
        if sim._clock is None:
            sim._clock = _CudaClock(device)
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device, priority=-1)
        issued = torch.cuda.current_stream(device)
        stream.wait_stream(issued)
        with torch.cuda.stream(stream):
            fill()
            written = sum(t.numel() * t.element_size() for t in tensors[:1])
            left = seconds - 2 * written / sim._clock.copy_bytes_per_s  # the copy read and wrote
            if left > 0:
                torch.cuda._sleep(sim._clock.cycles(left))
        for t in tensors:
            t.record_stream(stream)  # as ProcessGroupNCCL: the caller may free them before the end
        done = torch.cuda.Event()
        done.record(stream)
        return SimulatedWork(event=done, tensors=tensors)

    # ------------------------------------------------------------ collectives
    # Argument forms are torch's for Python process groups (torch/testing/_internal/
    # distributed/multi_threaded_pg.py has the same methods). `opts` carry the reduce op.
    def allreduce(self, tensors, opts=None):
        op = getattr(opts, "reduceOp", None)

        def fill():
            if _sum_factor(op):
                for t in tensors:
                    if t.dtype != torch.bool:
                        t.mul_(self._size)

        return self._run("all_reduce", _bytes(tensors), _dtype(tensors), list(tensors), fill)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def allgather(self, output_lists, inputs, opts=None):
        def fill():
            for outs, inp in zip(output_lists, inputs, strict=True):
                for out in outs:
                    if out.data_ptr() != inp.data_ptr():
                        out.copy_(inp)

        nbytes = sum(_bytes(outs) for outs in output_lists)
        flat_outs = [t for outs in output_lists for t in outs]
        return self._run("all_gather", nbytes, _dtype(inputs), flat_outs + list(inputs), fill)

    def all_gather_single(self, output, input, opts=None):
        def fill():
            chunks = output.view(self._size, -1)
            src = input.reshape(1, -1)
            r = self._rank
            # FSDP2 gathers in place: the input is this rank's chunk of the output.
            if r:
                chunks[:r].copy_(src.expand(r, -1))
            if r + 1 < self._size:
                chunks[r + 1 :].copy_(src.expand(self._size - r - 1, -1))
            if chunks[r].data_ptr() != src.data_ptr():
                chunks[r].copy_(src[0])

        return self._run("all_gather", _bytes([output]), output.dtype, [output, input], fill)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        work = SimulatedWork()
        for out, inp in zip(outputs, inputs, strict=True):
            work = self.all_gather_single(out, inp, opts)
        return work

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = getattr(opts, "reduceOp", None)

        def fill():
            for out, chunks in zip(outputs, input_lists, strict=True):
                out.copy_(chunks[self._rank])
                if _sum_factor(op):
                    out.mul_(self._size)

        nbytes = sum(_bytes(chunks) for chunks in input_lists)
        return self._run("reduce_scatter", nbytes, _dtype(outputs), list(outputs), fill)

    def reduce_scatter_single(self, output, input, opts=None):
        op = getattr(opts, "reduceOp", None)

        def fill():
            output.view(-1).copy_(input.view(self._size, -1)[self._rank])
            if _sum_factor(op):
                output.mul_(self._size)

        return self._run("reduce_scatter", _bytes([input]), input.dtype, [output, input], fill)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        work = SimulatedWork()
        for out, inp in zip(outputs, inputs, strict=True):
            work = self.reduce_scatter_single(out, inp, opts)
        return work

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        n = self._size
        out_sizes = list(output_split_sizes) if output_split_sizes else [output.shape[0] // n] * n
        in_sizes = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n

        def fill():
            start = sum(in_sizes[: self._rank])
            own = input.narrow(0, start, in_sizes[self._rank])
            offset = 0
            for rows in out_sizes:
                _copy_rows(output.narrow(0, offset, rows), own)
                offset += rows

        return self._run("all_to_all", _bytes([input]), input.dtype, [output, input], fill)

    def alltoall(self, outputs, inputs, opts=None):
        def fill():
            own = inputs[self._rank]
            for out in outputs:
                _copy_rows(out, own)

        return self._run("all_to_all", _bytes(inputs), _dtype(inputs), list(outputs) + list(inputs), fill)

    def broadcast(self, tensors, opts=None):
        return self._run("broadcast", _bytes(tensors), _dtype(tensors), list(tensors), lambda: None)

    def barrier(self, opts=None):
        return self._run("barrier", 0, None, [], lambda: None)

    def gather(self, output_lists, inputs, opts=None):
        def fill():  # on the root: every rank's tensor is this rank's
            for outs in output_lists:
                for out in outs:
                    out.copy_(inputs[0])

        return self._run("all_gather", _bytes(inputs) * self._size, _dtype(inputs), list(inputs), fill)

    def scatter(self, outputs, input_lists, opts=None):
        def fill():
            for out, chunks in zip(outputs, input_lists, strict=False):  # non-roots pass no chunks
                if chunks:
                    out.copy_(chunks[self._rank])

        return self._run("broadcast", _bytes(outputs) * self._size, _dtype(outputs), list(outputs), fill)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(tensors):
    return tensors[0].dtype if len(tensors) else None


def _copy_rows(out: torch.Tensor, own: torch.Tensor) -> None:
    """`out` <- the first rows of `own`, zeros past its end (an all-to-all's stand-in)."""
    rows = min(out.shape[0], own.shape[0])
    if rows:
        out[:rows].copy_(own[:rows])
    if rows < out.shape[0]:
        out[rows:].zero_()
