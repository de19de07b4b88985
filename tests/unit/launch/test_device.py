"""Device selection: cuda:LOCAL_RANK % device_count() whoever made the process group.

No GPU here: torch.cuda's queries and set_device are monkeypatched, and process groups are
either faked (their backend string is all `select_device` reads) or a real 1-process gloo
group on a FileStore.
"""

from __future__ import annotations

import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from zeroshard.config.choices import DEFAULT_COLLECTIVE_TIMEOUT_S
from zeroshard.launch import distributed
from zeroshard.launch.device import backends_by_device, binds_device_id, select_device, uses_nccl


class FakeCuda:
    """torch.cuda with `count` GPUs: records set_device; current_device follows it."""

    def __init__(self, monkeypatch, count: int, current: int = 0) -> None:
        self.count, self.current, self.set_calls = count, current, []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)

    def _set_device(self, device) -> None:
        index = device.index if isinstance(device, torch.device) else int(device)
        self.set_calls.append(index)
        self.current = index


def fake_group(monkeypatch, backend_config: str, world_size: int) -> None:
    """The default group as select_device sees it, without creating one."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: backend_config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend_config.split(",")[-1].split(":")[-1])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world_size)


class CudaPlacedModel(nn.Module):
    """Reports its parameters on cuda:0, as a model the user moved to a GPU would."""

    def parameters(self, recurse: bool = True):
        yield types.SimpleNamespace(device=torch.device("cuda", 0))


def set_env(monkeypatch, **variables: str) -> None:
    for key, value in variables.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_backend_strings():
    assert backends_by_device("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert backends_by_device("gloo") == {"cpu": "gloo", "cuda": "gloo"}
    assert backends_by_device("NCCL") == {"cuda": "nccl"}
    assert uses_nccl("nccl") and uses_nccl("cpu:gloo,cuda:nccl")
    assert not uses_nccl("gloo") and not uses_nccl("cpu:gloo")


def test_cpu_without_cuda(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert select_device() == torch.device("cpu")
    assert cuda.set_calls == []


@pytest.mark.parametrize("local_rank,count,expected", [(0, 4, 0), (3, 4, 3), (5, 4, 1), (1, 1, 0)])
def test_local_rank_modulo_device_count(monkeypatch, local_rank, count, expected):
    cuda = FakeCuda(monkeypatch, count=count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert select_device() == torch.device("cuda", expected)
    assert cuda.set_calls == [expected]


@pytest.mark.parametrize("backend_config", ["cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_a_group_someone_else_made_still_gets_the_local_rank_gpu(monkeypatch, backend_config):
    """The user's, a trainer's or dist_init_required=False: current_device is still 0 here,
    which is what every rank used to compute on."""
    cuda = FakeCuda(monkeypatch, count=8, current=0)
    fake_group(monkeypatch, backend_config, world_size=16)
    monkeypatch.setenv("LOCAL_RANK", "6")
    assert select_device() == torch.device("cuda", 6)
    assert cuda.set_calls == [6]


def test_single_process_without_local_rank_keeps_the_current_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=4, current=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert select_device() == torch.device("cuda", 2)
    assert cuda.set_calls == [2]


def test_several_processes_without_local_rank_are_refused(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    fake_group(monkeypatch, "cuda:nccl", world_size=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not set: with 2 processes and 2 GPUs"):
        select_device()


def test_one_gpu_needs_no_local_rank(monkeypatch):
    FakeCuda(monkeypatch, count=1)
    fake_group(monkeypatch, "cuda:nccl", world_size=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert select_device() == torch.device("cuda", 0)


def test_bad_local_rank_is_named(monkeypatch):
    FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(RuntimeError, match="LOCAL_RANK='first': must be a non-negative integer"):
        select_device()


def test_gloo_group_trains_on_the_cpu_and_says_so(monkeypatch, gloo_group):
    cuda = FakeCuda(monkeypatch, count=2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.warns(UserWarning, match="training on the CPU although CUDA is available"):
        assert select_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert cuda.set_calls == []


def test_cuda_model_under_gloo_group_is_refused_by_initialize(monkeypatch, gloo_group):
    FakeCuda(monkeypatch, count=2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(RuntimeError, match=r"the model is on cuda:0 but the process group's backend is 'gloo'"):
        zeroshard.initialize(model=CudaPlacedModel(), config=config, dist_init_required=False)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_init_distributed_binds_the_nccl_group_to_the_local_gpu(monkeypatch, backend):
    cuda = FakeCuda(monkeypatch, count=4)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    set_env(monkeypatch, RANK="7", WORLD_SIZE="8", LOCAL_RANK="7", MASTER_ADDR="h", MASTER_PORT="1")
    distributed.init_distributed(dist_backend=backend)
    timeout = timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)  # zeroshard's default, not torch's 30 min
    assert calls == [{"backend": backend, "device_id": torch.device("cuda", 3), "timeout": timeout}]
    assert cuda.set_calls == [3]


def test_init_distributed_gloo_binds_no_device(monkeypatch):
    cuda = FakeCuda(monkeypatch, count=0)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    set_env(monkeypatch, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1")
    distributed.init_distributed()
    assert calls == [{"backend": "gloo", "timeout": timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)}]
    assert cuda.set_calls == []


@pytest.mark.parametrize("world_size,setting,binds", [
    (8, None, True), (1, None, False), (8, "0", False), (8, "off", False), (1, "1", True),
])
def test_device_id_binding(monkeypatch, world_size, setting, binds):
    """set_device always; device_id only for several ranks unless ZEROSHARD_NCCL_DEVICE_ID says."""
    cuda = FakeCuda(monkeypatch, count=4)
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    set_env(monkeypatch, RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="2", MASTER_ADDR="h", MASTER_PORT="1")
    if setting is not None:
        monkeypatch.setenv("ZEROSHARD_NCCL_DEVICE_ID", setting)
    distributed.init_distributed(dist_backend="nccl")
    assert ("device_id" in calls[0]) == binds
    assert cuda.set_calls == [2]


def test_bad_device_id_setting_is_named(monkeypatch):
    monkeypatch.setenv("ZEROSHARD_NCCL_DEVICE_ID", "maybe")
    with pytest.raises(ValueError, match="ZEROSHARD_NCCL_DEVICE_ID='maybe': must be 0 or 1"):
        binds_device_id(2)


def test_a_group_made_under_srun_without_local_rank_uses_slurm_localid(monkeypatch):
    """A user's own init_process_group under srun: LOCAL_RANK unset, SLURM_LOCALID says the GPU."""
    cuda = FakeCuda(monkeypatch, count=4)
    fake_group(monkeypatch, "cuda:nccl", world_size=8)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    set_env(monkeypatch, SLURM_PROCID="6", SLURM_LOCALID="2", SLURM_NTASKS="8")
    assert select_device() == torch.device("cuda", 2)
    assert cuda.set_calls == [2]
