"""DeepSpeed's `deepspeed` launcher command on one node, run by torchrun.

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds.json

takes DeepSpeed 0.19.8's runner flags (same names, spellings and defaults) and chooses the
devices as DeepSpeed does: every visible GPU, the first N with `--num_gpus N`, or the slots of
`--include localhost:0,2` / `--exclude localhost:1`, handed to the processes through
CUDA_VISIBLE_DEVICES; CUDA_VISIBLE_DEVICES set by the user acts as `--include` when none of
those flags is given. Without GPUs one process runs, unless `--num_gpus` says how many.

The command then becomes torchrun (exec, same process id), which runs one process per device
(its agent forwards SIGTERM to the workers, which
zeroshard's preemption handling relies on, ends every rank when one fails, and returns non-zero
then), each through zeroshard/launch/deepspeed_rank.py, which appends `--local_rank=<n>` to the
script's arguments as DeepSpeed's per-node launcher does. The environment holds what DeepSpeed's
launcher sets: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun's), LOCAL_SIZE,
CROSS_RANK and CROSS_SIZE.

Several nodes (a hostfile with more than one host, `--num_nodes` > 1, `--force_multi`) are
refused: DeepSpeed reaches the other nodes over pdsh/ssh or an MPI launcher, which zeroshard does
not drive; torchrun on each node, srun or mpirun do, and zeroshard reads their environment
(docs/launching.md). Flags that tune only what DeepSpeed's runner does (`--save_pid`,
`--enable_each_rank_log`, `--bind_cores_to_rank`, `--bind_core_list`) are accepted with one
warning that they have no effect; `--autotuning`, which would run DeepSpeed's autotuner instead
of the training, is refused.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

# DeepSpeed's defaults (deepspeed/launcher/runner.py, deepspeed/constants.py).
DLTS_HOSTFILE = "/job/hostfile"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
PDSH_LAUNCHER = "pdsh"
LOCALHOST = "localhost"
LOOPBACK = "127.0.0.1"
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
EXIT_USAGE = 2
PROG = "deepspeed"
NO_EFFECT_FLAGS = ("--save_pid", "--enable_each_rank_log", "--bind_cores_to_rank", "--bind_core_list")
MULTI_NODE_FIX = (
    "zeroshard's `deepspeed` command runs one node. For several nodes run `torchrun --nnodes N "
    "--node_rank R --master_addr HOST --master_port PORT --nproc_per_node GPUS train.py ...` on each "
    "node, or start the ranks with `srun` or `mpirun`, whose environment zeroshard reads "
    "(docs/launching.md)."
)


class LaunchUsageError(ValueError):
    """The command line cannot be launched here; the message names the cause and the fix."""


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed 0.19.8's runner flags, names, spellings and defaults."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="DeepSpeed's launcher, run by zeroshard on one node with torchrun (one process per GPU).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("-H", "--hostfile", type=str, default=DLTS_HOSTFILE,
        help="MPI-style hostfile ('worker-0 slots=4'); a missing file means this machine only")
    add("-i", "--include", type=str, default="", help="devices to use, NODE_SPEC[@NODE_SPEC ...], e.g. localhost:0,2")
    add("-e", "--exclude", type=str, default="", help="devices not to use (same format as --include)")
    add("--num_nodes", type=int, default=-1, help="nodes to use (more than 1 is refused: one node only)")
    add("--num_gpus", "--num_accelerators", type=int, default=-1, help="GPUs to use: ids [0:N)")
    add("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="rendezvous port")
    add("--master_addr", type=str, default="",
        help="address of node 0 (on one node without a hostfile, 127.0.0.1, as DeepSpeed)")
    add("--node_rank", type=int, default=-1, help="this node's index (with --no_ssh; 0 on one node)")
    add("--launcher", type=str, default=PDSH_LAUNCHER, help="multi-node backend (only one node is run here)")
    add("--launcher_args", type=str, default="", help="multi-node backend arguments (no effect on one node)")
    add("--module", action="store_true", help="run the script as a module, as 'python -m'")
    add("--no_python", action="store_true", help="execute the script directly, without 'python'")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=<n> to the script")
    add("--no_ssh", action="store_true", help="launch this node only, without ssh")
    add("--no_ssh_check", action="store_true", help="skip the ssh check (no effect on one node)")
    add("--force_multi", action="store_true", help="multi-node mode (refused: one node only)")
    add("--save_pid", action="store_true", help="no effect in zeroshard (warned)")
    add("--enable_each_rank_log", type=str, default="None", help="no effect in zeroshard (warned)")
    add("--autotuning", type=str, default="", choices=["tune", "run"],
        help="refused: zeroshard has no autotuner")
    add("user_script", type=str, help="the training script, followed by its arguments")
    add("user_args", nargs=argparse.REMAINDER)
    add("--bind_cores_to_rank", action="store_true", help="no effect in zeroshard (warned)")
    add("--bind_core_list", type=str, default=None, help="no effect in zeroshard (warned)")
    add("--ssh_port", type=int, default=None, help="ssh port (no effect on one node)")
    add("--venv_script", type=str, default=None, help="multi-node venv activation script (no effect on one node)")
    add("--log_level", type=str, default="info", choices=["debug", "info", "warning", "error", "critical"],
        help="this launcher's messages")
    add("-q", "--quiet", action="store_true", help="as --log_level error")
    return parser


@dataclass
class Launch:
    """What runs: the torchrun command, the environment it gets, and what to tell the user."""

    command: list[str]
    env: dict[str, str]
    slots: list[int]
    notes: list[str] = field(default_factory=list)  # info-level messages
    warnings: list[str] = field(default_factory=list)


def parse_hostfile(text: str, path: str) -> OrderedDict[str, int]:
    """`host slots=N` lines (comments and blank lines skipped), as DeepSpeed reads a hostfile."""
    pool: OrderedDict[str, int] = OrderedDict()
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if match is None:
            raise LaunchUsageError(f"hostfile {path}: bad line {line!r}; each line is 'HOST slots=N'.")
        if match.group(1) in pool:
            raise LaunchUsageError(f"hostfile {path}: {match.group(1)} is listed twice; list each host once.")
        pool[match.group(1)] = int(match.group(2))
    if not pool:
        raise LaunchUsageError(f"hostfile {path} lists no host; write 'HOST slots=N' lines or remove the file.")
    return pool


def _node_specs(spec: str, flag: str) -> OrderedDict[str, list[int]]:
    """'worker-0@worker-1:0,2' -> {worker-0: [], worker-1: [0, 2]} (empty: the whole host)."""
    specs: OrderedDict[str, list[int]] = OrderedDict()
    for part in spec.split("@"):
        host, _, slots = part.partition(":")
        try:
            numbers = [int(s) for s in slots.split(",")] if slots else []
        except ValueError:
            raise LaunchUsageError(
                f"{flag} {spec!r}: {part!r} is not HOST or HOST:SLOT[,SLOT...] with integer slots, "
                "e.g. localhost:0,2."
            ) from None
        specs.setdefault(host, [])
        specs[host] = sorted(set(specs[host] + numbers))
    return specs


def filter_resources(pool: OrderedDict[str, int], include: str, exclude: str) -> OrderedDict[str, list[int]]:
    """The slots left on each host after `--include` or `--exclude`, as DeepSpeed's runner filters
    them (hosts in pool order; a named slot that the host does not have is an error)."""
    available = OrderedDict((host, list(range(slots))) for host, slots in pool.items())
    if include and exclude:
        raise LaunchUsageError("--include and --exclude cannot be used together; give one of them.")
    if not include and not exclude:
        return available
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen: dict[str, list[int]] = {} if include else {h: list(s) for h, s in available.items()}
    for host, slots in _node_specs(spec, flag).items():
        if host not in available:
            raise LaunchUsageError(
                f"{flag} {spec!r}: host {host!r} is not there (hosts: {', '.join(available)}); "
                f"on this machine write {LOCALHOST}:SLOTS, e.g. {LOCALHOST}:0,1."
            )
        missing = [s for s in slots if s not in available[host]]
        if missing:
            have = ", ".join(map(str, available[host])) or "none"
            raise LaunchUsageError(
                f"{flag} {spec!r}: {host} has no device {', '.join(map(str, missing))} (it has {have}); "
                "name only devices that exist."
            )
        if include:
            chosen[host] = slots or available[host]
        else:
            chosen[host] = [s for s in chosen[host] if s not in slots] if slots else []
    return OrderedDict((h, chosen[h]) for h in available if chosen.get(h))


def plan_launch(args: argparse.Namespace, environ: dict[str, str], gpu_count: int,
                hostfile_text: str | None) -> Launch:
    """The launch for parsed `args`: pure, so each flag's effect can be tested without GPUs.

    `gpu_count` is the machine's GPUs with CUDA_VISIBLE_DEVICES ignored (DeepSpeed counts them
    so); `hostfile_text` is the hostfile's contents, None when there is none.
    """
    notes: list[str] = []
    if args.autotuning:
        raise LaunchUsageError(
            f"--autotuning {args.autotuning}: zeroshard has no autotuner (DeepSpeed's would run instead of the "
            "training). Drop the flag and set the batch size and ZeRO stage in the config; `zeroshard explain "
            "CONFIG` prints the memory each stage needs."
        )
    if args.module and args.no_python:
        raise LaunchUsageError("--module and --no_python cannot be used together; give one of them.")
    pool = parse_hostfile(hostfile_text, args.hostfile) if hostfile_text is not None else None
    env = dict(environ)
    visible = env.pop(VISIBLE_DEVICES, "")
    if pool is None and visible:
        if args.include or args.exclude or args.num_nodes > 1 or args.num_gpus > 0:
            notes.append(f"ignoring {VISIBLE_DEVICES}={visible}: --include/--exclude/--num_gpus/--num_nodes "
                         "choose the devices")
        else:
            args.include = f"{LOCALHOST}:{visible}"
            notes.append(f"{VISIBLE_DEVICES}={visible}: using --include={args.include}")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise LaunchUsageError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; choose the devices one way."
        )
    if args.force_multi:
        raise LaunchUsageError(f"--force_multi asks for DeepSpeed's multi-node launch. {MULTI_NODE_FIX}")
    if pool is None:
        if args.num_nodes > 1:
            raise LaunchUsageError(f"--num_nodes {args.num_nodes}: no hostfile lists other nodes, and "
                                   f"{MULTI_NODE_FIX}")
        pool = OrderedDict([(LOCALHOST, max(gpu_count, 1))])
        master_addr = LOOPBACK  # DeepSpeed's runner uses it on one node whatever --master_addr says
    else:
        master_addr = args.master_addr or LOOPBACK
    active = filter_resources(pool, args.include, args.exclude)
    if args.num_nodes > 0:
        active = OrderedDict(list(active.items())[: args.num_nodes])
    if len(active) > 1:
        launcher = f" with --launcher {args.launcher}" if args.launcher.lower() != PDSH_LAUNCHER else ""
        raise LaunchUsageError(f"the hostfile {args.hostfile} gives {len(active)} nodes ({', '.join(active)})"
                               f"{launcher}. {MULTI_NODE_FIX}")
    if not active:
        raise LaunchUsageError(f"--exclude {args.exclude!r} leaves no device to run on; exclude fewer.")
    host, slots = next(iter(active.items()))
    if args.num_gpus > 0:
        if gpu_count and args.num_gpus > gpu_count:
            raise LaunchUsageError(f"--num_gpus {args.num_gpus}: this machine has {gpu_count} GPUs; "
                                   f"ask for at most {gpu_count}.")
        slots = list(range(args.num_gpus))
    if args.no_ssh and args.node_rank != 0:
        raise LaunchUsageError(f"--no_ssh with --node_rank {args.node_rank}: on one node the node rank is 0; "
                               "pass --node_rank 0.")
    if not (args.module or args.no_python) and not os.path.isfile(args.user_script):
        raise LaunchUsageError(f"{args.user_script}: no such file; give the training script's path "
                               "(or --module for a module name).")
    nproc = len(slots)
    if gpu_count:
        env[VISIBLE_DEVICES] = ",".join(map(str, slots))
    env.update(MASTER_ADDR=master_addr, MASTER_PORT=str(args.master_port), WORLD_SIZE=str(nproc),
               LOCAL_SIZE=str(nproc), CROSS_RANK="0", CROSS_SIZE="1")
    # torchrun would set 1 thread per process (with a warning); DeepSpeed's launcher leaves the
    # default (all cores each). Share the cores, as `zeroshard launch` does.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    rank_flags = [flag for flag, on in (("--module", args.module), ("--no_python", args.no_python),
                                        ("--no_local_rank", args.no_local_rank)) if on]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node_rank", "0",
        "--nproc_per_node", str(nproc), "--master_addr", master_addr, "--master_port", str(args.master_port),
        "--module", "zeroshard.launch.deepspeed_rank", *rank_flags, args.user_script, *args.user_args,
    ]
    unused = [flag for flag, on in (
        ("--save_pid", args.save_pid), ("--enable_each_rank_log", args.enable_each_rank_log != "None"),
        ("--bind_cores_to_rank", args.bind_cores_to_rank), ("--bind_core_list", args.bind_core_list is not None),
    ) if on]
    warnings = []
    if unused:
        warnings.append(f"{', '.join(unused)}: no effect in zeroshard (DeepSpeed's launcher options; torchrun "
                        "runs the processes and their output stays on this console)")
    where = f"{host} devices {','.join(map(str, slots))}" if gpu_count else f"{nproc} CPU process(es)"
    notes.append(f"{where}; cmd = {' '.join(command)}")
    return Launch(command=command, env=env, slots=slots, notes=notes, warnings=warnings)


def physical_gpu_count() -> int:
    """GPUs on this machine whatever CUDA_VISIBLE_DEVICES says (torch reads it at each count
    until CUDA is initialized, which this launcher never does)."""
    import torch

    saved = os.environ.pop(VISIBLE_DEVICES, None)
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    finally:
        if saved is not None:
            os.environ[VISIBLE_DEVICES] = saved


def run(launch: Launch) -> NoReturn:
    """Become torchrun (exec: same process id). A signal sent to the `deepspeed` command then
    reaches torchrun once, which passes it to every rank, and the command's exit status is
    torchrun's; a launcher process in between would either not forward signals or, under a
    scheduler that signals every process of the job, deliver them twice."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(launch.command[0], launch.command, launch.env)


def main(argv: list[str] | None = None) -> int:
    """The `deepspeed` command: exit 2 with one message saying what to change, or become torchrun
    (this process runs the training and does not return)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    level = "error" if args.quiet else args.log_level
    try:
        hostfile = Path(args.hostfile)
        text = hostfile.read_text(encoding="utf-8") if hostfile.is_file() else None
        launch = plan_launch(args, dict(os.environ), physical_gpu_count(), text)
    except LaunchUsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if level in ("debug", "info"):
        for note in launch.notes:
            print(f"[{PROG} (zeroshard)] {note}", file=sys.stderr)
    if level in ("debug", "info", "warning"):
        for warning in launch.warnings:
            print(f"[{PROG} (zeroshard)] warning: {warning}", file=sys.stderr)
    run(launch)


if __name__ == "__main__":
    sys.exit(main())
