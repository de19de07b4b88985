"""torchrun's environment from other launchers: Slurm's srun, Open MPI's mpirun, PMI (MPICH,
Intel MPI's hydra).

torch's `env://` rendezvous reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and zeroshard
picks the GPU from LOCAL_RANK. srun and mpirun set their own variables instead; without a
mapping every process would train alone at world size 1. As DeepSpeed's `init_distributed`
does for MPI, the launcher's rank, size and local rank become torchrun's variables; what the
launcher does not say (the address of rank 0's host) comes from MASTER_ADDR when the user set
it, from the launcher where it names it, or is refused with the variable to set.

Variables already set are kept: a user's MASTER_ADDR wins, and torchrun run under srun (one
torchrun per node) is torchrun's job, since RANK and WORLD_SIZE are then set.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

# torch.distributed's conventional rendezvous port (torchrun's default, DeepSpeed's too).
DEFAULT_MASTER_PORT = 29500
# The file of extra environment variables DeepSpeed's multi-node runner exports to every node
# (Accelerate writes it for `accelerate launch --use_deepspeed`); zeroshard's launchers do not read it.
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
# Slurm jobs sharing a node must not share a port: the port is derived from the job id.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 20000, 10000
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LOOPBACK = "127.0.0.1"


class LaunchError(RuntimeError):
    """The launcher's variables do not say how to build the process group."""


@dataclass(frozen=True)
class LaunchEnv:
    """Who launched this process and the torchrun variables that follow from it."""

    launcher: str  # "torchrun", "slurm", "openmpi", "pmi"
    rank: int
    world_size: int
    local_rank: int | None
    master_addr: str
    master_port: int

    def torchrun_variables(self) -> dict[str, str]:
        variables = {
            "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
        }
        if self.local_rank is not None:
            variables["LOCAL_RANK"] = str(self.local_rank)
        return variables


def _int(environ: Mapping[str, str], key: str) -> int | None:
    value = environ.get(key)
    if value is None or value.strip() == "":
        return None
    if not value.strip().isdigit():
        raise LaunchError(f"{key}={value!r}: must be a non-negative integer. Fix or unset it.")
    return int(value)


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist: "gpu[03-05,9],cpu1" -> "gpu03"."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    # Each bracket holds ranges and single values; the first host takes the first of each.
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], first)


def _master_port(environ: Mapping[str, str], default: int) -> int:
    port = _int(environ, "MASTER_PORT")
    return default if port is None else port


def _slurm(environ: Mapping[str, str]) -> LaunchEnv | None:
    # SLURM_LOCALID is set for srun's tasks only (a batch script's own shell has SLURM_NTASKS
    # and may have SLURM_PROCID, but is one process).
    if "SLURM_PROCID" not in environ or "SLURM_LOCALID" not in environ:
        return None
    size_key = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"
    rank, world_size = _int(environ, "SLURM_PROCID"), _int(environ, size_key)
    local_rank = _int(environ, "SLURM_LOCALID")
    if rank is None or world_size is None:
        raise LaunchError(
            f"srun: SLURM_PROCID={environ.get('SLURM_PROCID')!r} and {size_key}={environ.get(size_key)!r}: "
            "both are needed. Run under srun, or set RANK and WORLD_SIZE."
        )
    if world_size <= 1:
        return None
    master = environ.get("MASTER_ADDR")
    if not master:
        nodelist = next((environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
                         if environ.get(k)), None)
        if nodelist is None:
            raise LaunchError(
                "srun: no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST names rank 0's host. Set MASTER_ADDR "
                "to it (e.g. MASTER_ADDR=$(scontrol show hostnames | head -n1))."
            )
        # Task 0 runs on the step's first node (block and cyclic distributions alike). Not
        # SLURM_LAUNCH_NODE_IPADDR: that is where srun ran, a login node under salloc.
        master = first_slurm_host(nodelist)
    job_id = _int(environ, "SLURM_JOB_ID")
    default_port = DEFAULT_MASTER_PORT if job_id is None else SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN
    return LaunchEnv("slurm", rank, world_size, local_rank, master, _master_port(environ, default_port))


def _mpi_master(environ: Mapping[str, str], launcher: str, world_size: int, local_size: int | None) -> str:
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    # Azure ML runs mpirun and names the head node (host:port for multi-node jobs).
    for key in ("AZ_BATCH_MASTER_NODE", "AZ_BATCHAI_MPI_MASTER_NODE"):
        if environ.get(key):
            return environ[key].split(":")[0]
    if local_size is not None and local_size == world_size:
        return LOOPBACK  # every rank is on this machine
    raise LaunchError(
        f"{launcher}: the job spans several machines and nothing names rank 0's host. Set MASTER_ADDR "
        "(and MASTER_PORT, default 29500) for every rank, e.g. `mpirun -x MASTER_ADDR=<host of rank 0> ...`."
    )


def _openmpi(environ: Mapping[str, str]) -> LaunchEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    rank, world_size = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
    if rank is None or world_size is None:
        raise LaunchError("mpirun: OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not. Set WORLD_SIZE.")
    if world_size <= 1:
        return None
    local_size = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
    master = _mpi_master(environ, "mpirun", world_size, local_size)
    return LaunchEnv("openmpi", rank, world_size, _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK"), master,
                     _master_port(environ, DEFAULT_MASTER_PORT))


def _pmi(environ: Mapping[str, str]) -> LaunchEnv | None:
    if "PMI_RANK" not in environ:
        return None
    rank, world_size = _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE")
    if rank is None or world_size is None:
        raise LaunchError("PMI: PMI_RANK is set but PMI_SIZE is not. Set WORLD_SIZE.")
    if world_size <= 1:
        return None
    # Hydra (MPICH, Intel MPI) exports the node-local rank and count as MPI_LOCALRANKID /
    # MPI_LOCALNRANKS; other PMI launchers may not, and then LOCAL_RANK stays unknown.
    local_rank = _int(environ, "MPI_LOCALRANKID")
    if local_rank is None:
        local_rank = _int(environ, "PMI_LOCAL_RANK")
    local_size = _int(environ, "MPI_LOCALNRANKS")
    if local_size is None:
        local_size = _int(environ, "PMI_LOCAL_SIZE")
    master = _mpi_master(environ, "PMI", world_size, local_size)
    return LaunchEnv("pmi", rank, world_size, local_rank, master, _master_port(environ, DEFAULT_MASTER_PORT))


def discover_launch(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launch this process is part of, or None for a lone process.

    torchrun's variables (RANK and WORLD_SIZE) win; then srun's, Open MPI's and PMI's. srun or
    mpirun with one process is a lone process (no group); torchrun's complete environment makes
    a group even of one, as before.

    Raises:
        LaunchError: a launcher's variables are there but cannot be mapped (no address for
            rank 0's host on several machines, a missing size); the message names what to set.
    """
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        rank, world_size = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
        if rank is None or world_size is None:
            raise LaunchError(
                f"RANK={environ.get('RANK')!r}, WORLD_SIZE={environ.get('WORLD_SIZE')!r}: set both (torchrun does)."
            )
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(k)]
        if missing and world_size <= 1:
            return None  # a lone process that happens to have RANK=0, WORLD_SIZE=1
        if missing:
            raise LaunchError(
                f"RANK and WORLD_SIZE={world_size} are set but {' and '.join(missing)} not: set "
                f"{' and '.join(missing)} to rank 0's host and a free port there, or launch with torchrun."
            )
        return LaunchEnv("torchrun", rank, world_size, _int(environ, "LOCAL_RANK"), environ["MASTER_ADDR"],
                         _master_port(environ, DEFAULT_MASTER_PORT))
    for discover in (_slurm, _openmpi, _pmi):
        launch = discover(environ)
        if launch is not None:
            return launch
    return None


def launcher_local_rank(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's index on its machine as its launcher says it: LOCAL_RANK, else srun's,
    Open MPI's or hydra's own variable (a group the user made under srun or mpirun)."""
    environ = os.environ if environ is None else environ
    for key in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK"):
        value = _int(environ, key)
        if value is not None:
            return value
    return None


def export_launch(launch: LaunchEnv, environ: MutableMapping[str, str] | None = None) -> None:
    """Set torchrun's variables for `launch`, keeping any already set."""
    environ = os.environ if environ is None else environ
    for key, value in launch.torchrun_variables().items():
        environ.setdefault(key, value)
