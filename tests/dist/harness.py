"""A pool of gloo worker processes that runs many distributed test tasks per start.

Starting a process group from scratch costs 3-4 s on a 2-core machine (each process imports
torch), so `DistPool` starts `world_size` workers once and then runs task after task on them
(workers are forked from a forkserver that has imported torch; see START_METHOD_ENV):

    pool = DistPool(2)
    ranks = pool.run(check_allreduce, 3.0, timeout=30)   # one result per rank, in rank order
    pool.close()

In a test, use the session fixture instead: `dist_pool(2).run(fn, *args, **kwargs)`.

A task is a module-level function (or a "package.module:qualname" string naming one). Every
rank calls `fn(*args, **kwargs)` with `torch.distributed` already initialised (gloo, CPU) and
torchrun's environment variables set, and returns a picklable value; tensors in the value
(inside lists, tuples and dicts too) come back as compact CPU copies. Before each task a worker
seeds torch and `random` with 0, turns deterministic algorithms off, restores the default
dtype, grad mode and the environment; after it, it runs `gc.collect()` (then `gc.freeze()`, so
the next collect only scans what later tasks allocate).

If any rank raises, `run` raises `DistTaskError` with every failing rank's full traceback and
the tail of each rank's output, and shuts the workers down: the others may be stuck in a
collective waiting for the failed rank, and even if they are not, gloo may hold half-finished
traffic. A task that runs past `timeout` raises `DistTimeoutError` with the stack of every rank
still running. Either way the next `run` starts fresh workers, so one failing test does not
break the tests after it.

What a worker prints (stdout and stderr, C++ included) is collected per task and echoed to the
test's stdout prefixed with `[rank N]`, so pytest shows it with the test it belongs to.

Notes for task authors:
- Assertions in modules imported only by workers are not rewritten by pytest, so a bare
  `assert a == b` reports no values; use `torch.testing.assert_close` or give a message.
- Keyword arguments for the task cannot be named `timeout` (that is `run`'s).
- A task that destroys the default process group is allowed; the pool respawns afterwards.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

__all__ = ["DistPool", "DistTaskError", "DistTimeoutError", "close_shared_pools", "discard_workers", "shared_pool"]

REPO_ROOT = Path(__file__).resolve().parents[2]

# Spawning and importing torch on a loaded 2-core machine; generous, only hit if broken.
STARTUP_TIMEOUT_S = 180.0
# gloo's own timeout for a collective; a stuck collective shows up as a `run` timeout first.
PROCESS_GROUP_TIMEOUT_S = 60.0
# After the first rank fails, how long to wait for the others to report their own errors
# before shutting them down; a rank blocked in a collective never will.
GRACE_AFTER_FAILURE_S = 1.0
# How long a worker may take to write its stack after the parent asks for it.
STACK_DUMP_WAIT_S = 1.0
OUTPUT_TAIL_LINES = 40
# How workers are started. "forkserver" (default): one server process imports torch once and
# forks every worker from it, so a worker starts in ~0.1 s instead of the 2-4 s a spawned
# process needs to import torch, and a pool that had to be torn down comes back cheaply. The
# server is a fresh interpreter that has only imported modules, never run torch ops, created
# a process group or touched a GPU, so forking it carries none of fork()'s usual hazards.
# "spawn" starts each worker from scratch; set the variable to "spawn" to rule the
# forkserver out when debugging something odd.
START_METHOD_ENV = "ZEROSHARD_DIST_START_METHOD"
# torch._dynamo: the first torch optimizer imports it (measured 7 s of CPU on a loaded 2-core
# machine), so without it every fresh worker paid that on its first engine; importing it starts
# no thread, so forking after it is as safe as after torch.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest"]

TaskFn = Callable[..., Any] | str
# Tells a worker to leave; a pickled task never equals it (pickles start with b"\x80").
_STOP = b"stop"


class DistTaskError(RuntimeError):
    """A task failed on at least one rank. `failures` maps rank -> traceback text."""

    def __init__(self, message: str, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or {}


class DistTimeoutError(DistTaskError):
    """A task did not finish on every rank within its timeout."""


# ---------------------------------------------------------------------------------------------
# Worker side. Nothing here runs in the pytest process.
# ---------------------------------------------------------------------------------------------

_stack_file = None  # kept open for faulthandler for the worker's lifetime
_discard = False  # set by discard_workers(): this worker leaves after its task


def discard_workers() -> None:
    """Rank-side: this worker's process group cannot be used again (the task left collectives
    in flight, as a diagnosed hang does: zeroshard/comm/watchdog.py). After the task the pool
    ends its workers without `destroy_process_group`, which would wait for those collectives
    until they time out, and the next `run` starts fresh ones."""
    global _discard
    _discard = True


def _resolve_task(spec: str) -> Callable[..., Any]:
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"task {spec!r}: expected 'package.module:function'.")
    target: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _to_cpu(value: Any) -> Any:
    """Compact, detached CPU copies of every tensor in nested lists, tuples and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        # clone(): a view would otherwise pickle its whole storage (e.g. a full flat buffer).
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return type(value)((k, _to_cpu(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    if isinstance(value, tuple):
        items = [_to_cpu(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _exit_when_orphaned(lifeline: Connection) -> None:
    """Exit as soon as the pool's owner is gone, even mid-task (it may be killed by SIGKILL).

    Only the owning process holds the lifeline's write end and it never writes, so a read
    returns only when that process closes it or dies. A worker forked by the forkserver is
    not the owner's child, and holds the forkserver's own liveness pipe open, so neither a
    parent-death signal nor the forkserver's exit would end a worker stuck in a task.
    """
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(70)


def _reset_between_tasks(env: dict[str, str]) -> None:
    import torch

    os.environ.clear()
    os.environ.update(env)
    torch.manual_seed(0)
    random.seed(0)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(0)
    # Only when on: the setter imports torch._inductor (800 modules, seconds of CPU).
    if torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(False)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _run_one_task(payload: bytes, env: dict[str, str]) -> bytes:
    import torch.distributed as dist

    try:
        _, task, args, kwargs = pickle.loads(payload)
        fn = _resolve_task(task) if isinstance(task, str) else task
        _reset_between_tasks(env)
        result = _to_cpu(fn(*args, **kwargs))
        reply = pickle.dumps(("ok", result, dist.is_initialized() and not _discard), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:  # pytest.fail / skip raise BaseException subclasses; report them too
        reply = pickle.dumps(("error", traceback.format_exc(), dist.is_initialized() and not _discard))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    gc.collect()
    # What survived is live (modules, caches): freeze it so the next task's collect only
    # scans new objects. A full collect with torch loaded costs ~0.1 CPU-s per task, which is
    # a second or more of wall time on a loaded 2-core machine.
    gc.freeze()
    return reply


def _worker_main(
    rank: int,
    world_size: int,
    conn: Connection,
    lifeline: Connection,
    workdir: str,
    master_port: int,
) -> None:
    global _stack_file
    # Everything the worker prints, Python or C++, goes to its log; the parent echoes it.
    log_fd = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    threading.Thread(target=_exit_when_orphaned, args=(lifeline,), name="distpool-lifeline", daemon=True).start()
    import faulthandler

    _stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    # What torchrun sets, so code that reads it sees the world the process group has.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist
        import torch.distributed.nn.functional  # noqa: F401  before the group: see below

        # Imported after the group exists, that module would hold it in its default arguments
        # and the group's gloo threads would outlive destroy_process_group into interpreter
        # shutdown (an abort at exit): [Note: process-group lifetime] in zeroshard/launch/distributed.py.
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method="file://" + os.path.join(workdir, "rendezvous"),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
        )
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), False)))
        return
    gc.collect()
    gc.freeze()
    conn.send_bytes(pickle.dumps(("ready", os.getpid(), True)))
    env = dict(os.environ)
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break  # the parent is gone
        if payload == _STOP:
            break
        conn.send_bytes(_run_one_task(payload, env))
    if _discard:
        os._exit(0)  # see discard_workers
    if dist.is_initialized():
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _task_name(fn: TaskFn) -> str:
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _tail(text: str, lines: int = OUTPUT_TAIL_LINES) -> str:
    kept = text.rstrip("\n").splitlines()[-lines:]
    return "\n".join(kept)


class DistPool:
    """`world_size` gloo worker processes that run tasks on every rank (see module docstring).

    Args:
        world_size: Number of ranks, 1 or more.
        startup_timeout: Seconds allowed for spawning and forming the process group.
    """

    def __init__(
        self,
        world_size: int,
        *,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        start_method: str | None = None,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be at least 1.")
        start_method = start_method or os.environ.get(START_METHOD_ENV, "forkserver")
        if start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method={start_method!r} (or ${START_METHOD_ENV}): use 'forkserver' or 'spawn'.")
        self.start_method = start_method
        self.world_size = world_size
        self.startup_timeout = startup_timeout
        self.spawn_count = 0  # how many times workers were started; tests watch respawns
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._lifeline: Connection | None = None  # write end; workers exit when it closes
        self._workdir: str | None = None
        self._log_offsets: list[int] = []
        _LIVE_POOLS.add(self)

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        """Whether workers are running (they are started lazily by `run`)."""
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> None:
        """Spawn the workers and wait until their process group is formed."""
        if self.alive:
            return
        if self._procs:  # some worker died between tasks
            self._shutdown(graceful=False)
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        self._workdir = tempfile.mkdtemp(prefix=f"zeroshard-distpool-w{self.world_size}-")
        port = _free_port()
        lifeline_read, self._lifeline = ctx.Pipe(duplex=False)
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            # Not daemonic, so tasks may start processes of their own (DataLoader workers);
            # the lifeline and an atexit hook keep them from outliving pytest.
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, child_end, lifeline_read, self._workdir, port),
                name=f"distpool-w{self.world_size}-rank{rank}",
                daemon=False,
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        lifeline_read.close()
        self._log_offsets = [0] * self.world_size
        self.spawn_count += 1
        replies, errors, pending = self._collect(self.startup_timeout)
        if errors or pending:
            message = self._failure_message("starting the workers", errors, pending, self.startup_timeout)
            self._shutdown(graceful=False)
            raise DistTaskError(message, errors)

    def close(self) -> None:
        """Stop the workers (politely, then by force). The pool can be started again."""
        self._shutdown(graceful=True)

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running tasks -----------------------------------------------------------------------

    def run(self, fn: TaskFn, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` on every rank; return the results in rank order.

        Args:
            fn: A module-level function, or "package.module:qualname".
            *args, **kwargs: Picklable arguments, the same for every rank.
            timeout: Seconds for the whole task on all ranks.

        Raises:
            DistTaskError: a rank raised (message holds its traceback); workers are restarted
                by the next call.
            DistTimeoutError: the task ran past `timeout`; likewise.
            TypeError: `fn` or the arguments cannot be pickled.
        """
        name = _task_name(fn)
        try:
            payload = pickle.dumps(("task", fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            raise TypeError(
                f"task {name}: the function and its arguments must be picklable; the function must "
                f"be defined at module level of an importable module ({error})."
            ) from error
        if not self.alive:
            self.start()
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
            replies, errors, pending = self._collect(timeout)
        except BaseException:
            # Interrupted (Ctrl-C, pytest-timeout) or a pipe broke: the workers' state is unknown.
            self._shutdown(graceful=False)
            raise
        if errors or pending:
            message = self._failure_message(f"task {name}", errors, pending, timeout)
            self._shutdown(graceful=False)
            error_type = DistTimeoutError if pending and not errors else DistTaskError
            raise error_type(message, errors)
        self._echo_output()
        results = [replies[rank][1] for rank in range(self.world_size)]
        if not all(replies[rank][2] for rank in range(self.world_size)):
            # The task destroyed the process group: start fresh next time.
            self._shutdown(graceful=True)
        return results

    # -- internals ---------------------------------------------------------------------------

    def _collect(self, timeout: float) -> tuple[dict[int, tuple], dict[int, str], list[int]]:
        """Wait for one reply per rank. Returns (replies, errors by rank, ranks still running)."""
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        replies: dict[int, tuple] = {}
        errors: dict[int, str] = {}
        first_failure: float | None = None
        while pending:
            until = deadline if first_failure is None else min(deadline, first_failure + GRACE_AFTER_FAILURE_S)
            remaining = until - time.monotonic()
            if remaining <= 0:
                break
            waitables: dict[Any, int] = {}
            for rank in pending:
                waitables[self._conns[rank]] = rank
                waitables[self._procs[rank].sentinel] = rank
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                reply = self._read_reply(rank)
                if reply is None:
                    continue
                pending.discard(rank)
                if reply[0] == "error":
                    errors[rank] = reply[1]
                    if first_failure is None:
                        first_failure = time.monotonic()
                else:
                    replies[rank] = reply
        return replies, errors, sorted(pending)

    def _read_reply(self, rank: int) -> tuple | None:
        conn, proc = self._conns[rank], self._procs[rank]
        if conn.poll():
            try:
                return pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                pass
        if proc.is_alive():
            return None
        proc.join(1)
        return ("error", f"worker process exited (exit code {proc.exitcode}) without replying.\n", False)

    def _read_output(self, rank: int) -> str:
        assert self._workdir is not None
        path = os.path.join(self._workdir, f"rank{rank}.log")
        try:
            with open(path, "rb") as log:
                log.seek(self._log_offsets[rank])
                data = log.read()
        except FileNotFoundError:
            return ""
        self._log_offsets[rank] += len(data)
        return data.decode("utf-8", errors="replace")

    def _echo_output(self) -> None:
        for rank in range(self.world_size):
            text = self._read_output(rank)
            if text:
                prefixed = "".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True))
                sys.stdout.write(prefixed if prefixed.endswith("\n") else prefixed + "\n")

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask the ranks still running for their Python stacks (faulthandler on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1") or self._workdir is None:
            return {}
        paths = {rank: os.path.join(self._workdir, f"rank{rank}.stack") for rank in ranks}
        sizes = {rank: os.path.getsize(p) if os.path.exists(p) else 0 for rank, p in paths.items()}
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        stacks = {}
        for rank, path in paths.items():
            try:
                with open(path, "rb") as stack:
                    stack.seek(sizes[rank])
                    stacks[rank] = stack.read().decode("utf-8", errors="replace")
            except FileNotFoundError:
                stacks[rank] = ""
        return stacks

    def _failure_message(self, what: str, errors: dict[int, str], pending: list[int], timeout: float) -> str:
        world = f"world size {self.world_size}"
        parts = []
        if errors:
            failed = sorted(errors)
            parts.append(f"{what} failed on rank(s) {failed} ({world}).")
            for rank in failed:
                parts.append(f"--- rank {rank} traceback ---\n{errors[rank].rstrip()}")
            if pending:
                parts.append(
                    f"--- rank(s) {pending}: no reply within {GRACE_AFTER_FAILURE_S} s of the failure "
                    "(probably waiting in a collective for the failed rank); terminated ---"
                )
        else:
            finished = [r for r in range(self.world_size) if r not in pending]
            parts.append(
                f"{what} timed out after {timeout} s on rank(s) {pending} ({world}); "
                f"finished: {finished}. Stacks of the ranks still running:"
            )
            for rank, stack in self._dump_stacks(pending).items():
                parts.append(f"--- rank {rank} stack at timeout ---\n{stack.rstrip() or '(none written)'}")
        for rank in range(self.world_size):
            output = self._read_output(rank) if self._workdir else ""
            if output.strip():
                parts.append(f"--- rank {rank} output (last {OUTPUT_TAIL_LINES} lines) ---\n{_tail(output)}")
        parts.append("The workers were shut down; the next run() starts fresh ones.")
        return "\n".join(parts)

    def _shutdown(self, graceful: bool) -> None:
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        if graceful:
            for conn in conns:
                try:
                    conn.send_bytes(_STOP)
                except OSError:
                    pass
            for proc in procs:
                proc.join(5)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in conns:
            conn.close()
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


# Every pool ever made, so that atexit can stop the ones a test forgot to close. This hook is
# registered after multiprocessing's own, so it runs first (atexit is last-in, first-out) and
# multiprocessing never waits on a worker that is still serving.
_LIVE_POOLS: weakref.WeakSet[DistPool] = weakref.WeakSet()
_SHARED_POOLS: dict[int, DistPool] = {}


def shared_pool(world_size: int) -> DistPool:
    """The process-wide pool for `world_size` (created on first use, started on first run)."""
    if world_size not in _SHARED_POOLS:
        _SHARED_POOLS[world_size] = DistPool(world_size)
    return _SHARED_POOLS[world_size]


def close_shared_pools() -> None:
    """Stop every pool of this process."""
    pools = list(_LIVE_POOLS)  # before clearing, or the weak set loses the shared pools
    _SHARED_POOLS.clear()
    for pool in pools:
        pool.close()


atexit.register(close_shared_pools)
