"""torchrun's variables from srun, mpirun and PMI launchers (zeroshard.launch.launchers).

Environments are plain dicts (or monkeypatched os.environ for init_distributed, whose
init_process_group is replaced by a recorder); one test starts two real processes under a
Slurm-like environment and checks they form one gloo group of two.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from zeroshard.launch import distributed
from zeroshard.launch.launchers import (
    DEFAULT_MASTER_PORT,
    LaunchEnv,
    LaunchError,
    discover_launch,
    export_launch,
    first_slurm_host,
    launcher_local_rank,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# The torchrun variables as this test process started (normally none).
ORIGINAL_TORCHRUN_ENV = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ}

SRUN = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "16",
        "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_JOB_NODELIST": "gpu[01-10]", "SLURM_JOB_ID": "123456"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}


@pytest.mark.parametrize("nodelist,first", [
    ("node7", "node7"), ("gpu[07-10]", "gpu07"), ("gpu[3,5-6],cpu1", "gpu3"), ("a1,b[2-3]", "a1"),
    ("rack[1-2]-n[04-05]", "rack1-n04"), ("x-[9]", "x-9"),
])
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_srun():
    launch = discover_launch(SRUN)
    # The step's size and first node, not the job's; the port follows the job id.
    assert launch == LaunchEnv("slurm", 5, 8, 1, "gpu07", 20000 + 123456 % 10000)
    assert discover_launch({**SRUN, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}).torchrun_variables() == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}


def test_srun_without_step_size_uses_slurm_ntasks():
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert discover_launch(env).world_size == 16


def test_batch_script_shell_is_a_lone_process():
    """sbatch's own shell has SLURM_NTASKS (and SLURM_PROCID) but no SLURM_LOCALID: one process."""
    assert discover_launch({"SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_JOB_ID": "1"}) is None


def test_srun_without_a_nodelist_names_master_addr():
    env = {k: v for k, v in SRUN.items() if "NODELIST" not in k}
    with pytest.raises(LaunchError, match="Set MASTER_ADDR"):
        discover_launch(env)


def test_openmpi_on_one_machine():
    assert discover_launch(OPENMPI) == LaunchEnv("openmpi", 3, 4, 3, "127.0.0.1", DEFAULT_MASTER_PORT)


def test_openmpi_across_machines_needs_master_addr():
    env = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "8"}
    with pytest.raises(LaunchError, match=r"mpirun: the job spans several machines.*Set MASTER_ADDR"):
        discover_launch(env)
    assert discover_launch({**env, "MASTER_ADDR": "head"}).master_addr == "head"
    assert discover_launch({**env, "AZ_BATCH_MASTER_NODE": "10.1.2.3:6000"}).master_addr == "10.1.2.3"


def test_pmi():
    with pytest.raises(LaunchError, match=r"PMI: the job spans several machines.*MASTER_ADDR"):
        discover_launch(HYDRA)
    launch = discover_launch({**HYDRA, "MASTER_ADDR": "n1", "MASTER_PORT": "7000"})
    assert launch == LaunchEnv("pmi", 2, 4, 0, "n1", 7000)
    # Without hydra's local variables the local rank stays unknown (and the device choice says so).
    single = {"PMI_RANK": "1", "PMI_SIZE": "2", "MASTER_ADDR": "n1"}
    assert discover_launch(single).local_rank is None
    assert "LOCAL_RANK" not in discover_launch(single).torchrun_variables()


def test_torchrun_wins_over_the_launcher_it_runs_under():
    """torchrun under srun (one torchrun per node): SLURM_PROCID is the node, RANK the process."""
    env = {**SRUN, "RANK": "9", "WORLD_SIZE": "32", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29400"}
    assert discover_launch(env) == LaunchEnv("torchrun", 9, 32, 1, "h", 29400)


def test_incomplete_torchrun_variables_are_named():
    with pytest.raises(LaunchError, match="WORLD_SIZE=None: set both"):
        discover_launch({"RANK": "0"})
    with pytest.raises(LaunchError, match="MASTER_ADDR and MASTER_PORT not"):
        discover_launch({"RANK": "0", "WORLD_SIZE": "2"})
    assert discover_launch({"RANK": "0", "WORLD_SIZE": "1"}) is None


def test_one_process_launches_and_no_launcher_are_lone_processes():
    assert discover_launch({}) is None
    assert discover_launch({**OPENMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}) is None
    assert discover_launch({**SRUN, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}) is None


def test_bad_numbers_are_named():
    with pytest.raises(LaunchError, match="OMPI_COMM_WORLD_SIZE='four': must be a non-negative integer"):
        discover_launch({**OPENMPI, "OMPI_COMM_WORLD_SIZE": "four"})


def test_export_keeps_what_is_set():
    environ = {"MASTER_PORT": "1234"}
    export_launch(LaunchEnv("openmpi", 1, 2, 1, "127.0.0.1", 29500), environ)
    assert environ == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1234"}


def test_launcher_local_rank():
    assert launcher_local_rank({"LOCAL_RANK": "2", "SLURM_LOCALID": "1"}) == 2
    assert launcher_local_rank(SRUN) == 1
    assert launcher_local_rank(OPENMPI) == 3
    assert launcher_local_rank(HYDRA) == 0
    assert launcher_local_rank({}) is None


@pytest.fixture
def clean_environ(monkeypatch):
    """No launcher variables; init_process_group recorded, not run. The torchrun variables
    init_distributed exports are removed again afterwards (set-then-delete makes monkeypatch
    track them: left behind, RANK=3 WORLD_SIZE=4 sent later tests' initialize into a
    rendezvous that never completes)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key in list(os.environ):
        if key.startswith(("SLURM_", "OMPI_", "PMI_", "MPI_LOCAL", "AZ_BATCH")):
            monkeypatch.delenv(key)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    return calls


def test_init_distributed_under_mpirun_creates_the_group(monkeypatch, clean_environ):
    for key, value in OPENMPI.items():
        monkeypatch.setenv(key, value)
    distributed.init_distributed()
    assert clean_environ == [{"backend": "gloo", "timeout": timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)}]
    assert {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_init_distributed_refuses_rather_than_training_alone(monkeypatch, clean_environ):
    for key, value in {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "16"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        distributed.init_distributed()
    assert clean_environ == []
    assert "RANK" not in os.environ


def test_init_distributed_without_a_launcher_creates_nothing(clean_environ):
    distributed.init_distributed()
    assert clean_environ == []


def test_init_distributed_tests_leave_no_torchrun_variables_behind():
    """Runs after the tests above (file order): what they exported is gone."""
    leaked = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ}
    assert leaked == {k: v for k, v in ORIGINAL_TORCHRUN_ENV.items() if k in leaked}, leaked


RANK_SCRIPT = """
import torch, torch.distributed as dist, zeroshard
zeroshard.init_distributed()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(dist.get_rank(), dist.get_world_size(), zeroshard.launch.distributed.os.environ["LOCAL_RANK"], int(total.item()))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_srun_tasks_form_one_group():
    """Two processes with only srun's variables (and a free port) end up in one gloo group."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_"))
            and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    base.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()),
                SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost", SLURM_JOB_ID="7")
    procs = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)})
        for r in range(2)
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    assert outputs == [["0", "2", "0", "3"], ["1", "2", "1", "3"]]
