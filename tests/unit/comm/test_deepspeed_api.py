"""`zeroshard.comm` has DeepSpeed 0.19's `deepspeed.comm` functions, with DeepSpeed's parameter
names and order, and answers them in one process without a process group (zeroshard's world
of one). The 2-rank comparison with torch.distributed is tests/dist/comm/test_deepspeed_comm.py."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist

import zeroshard
import zeroshard.comm as ds_comm
from zeroshard.comm import collectives

# Leading parameters of each function in DeepSpeed 0.19's deepspeed/comm/comm.py, in order
# (written down from that file; the trailing prof/log_name/debug are accepted too).
DEEPSPEED_PARAMETERS = {
    "init_distributed": ["dist_backend", "auto_mpi_discovery", "distributed_port", "verbose", "timeout",
                         "init_method", "dist_init_required", "config", "rank", "world_size"],
    "is_initialized": [],
    "is_available": [],
    "destroy_process_group": ["group"],
    "new_group": ["ranks"],
    "get_rank": ["group"],
    "get_world_size": ["group"],
    "get_local_rank": [],
    "get_global_rank": ["group", "group_rank"],
    "get_all_ranks_from_group": ["group"],
    "barrier": ["group", "async_op", "device_ids"],
    "all_reduce": ["tensor", "op", "group", "async_op"],
    "broadcast": ["tensor", "src", "group", "async_op"],
    "all_gather": ["tensor_list", "tensor", "group", "async_op"],
    "all_gather_into_tensor": ["output_tensor", "tensor", "group", "async_op"],
    "reduce_scatter_tensor": ["output_tensor", "tensor", "op", "group", "async_op"],
    "all_to_all_single": ["output", "tensor", "output_split_sizes", "input_split_sizes", "group", "async_op"],
}


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "these tests are for a process without a process group"


@pytest.mark.parametrize("name", sorted(DEEPSPEED_PARAMETERS))
def test_deepspeed_signature(name: str) -> None:
    fn = getattr(zeroshard.comm, name)
    params = list(inspect.signature(fn).parameters)
    expected = DEEPSPEED_PARAMETERS[name]
    assert params[: len(expected)] == expected
    assert fn.__module__ == "zeroshard.comm.deepspeed_api"


def test_the_package_exports_deepspeeds_names_and_keeps_the_recorder() -> None:
    for name in ("all_reduce", "broadcast", "all_gather", "all_to_all_single", "new_group"):
        assert getattr(zeroshard.comm, name) is not getattr(collectives, name), name
    for name in ("recording", "CollectiveLog", "CollectiveRecord", "Group"):
        assert getattr(zeroshard.comm, name) is getattr(collectives, name), name
    assert set(zeroshard.comm.__all__) >= set(DEEPSPEED_PARAMETERS) | {"ReduceOp", "recording", "Group"}


def test_reduce_op_names_map_to_torchs() -> None:
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"):
        assert ds_comm.deepspeed_api._torch_op(getattr(ds_comm.ReduceOp, name)) == getattr(dist.ReduceOp, name)
    assert ds_comm.deepspeed_api._torch_op(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
    with pytest.raises(ValueError, match="UNUSED"):
        ds_comm.deepspeed_api._torch_op(ds_comm.ReduceOp.UNUSED)


def test_a_world_of_one_without_a_process_group(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_SIZE", "PMI_RANK"):
        monkeypatch.delenv(key, raising=False)
    ds_comm.init_distributed()  # no launcher: no group, as zeroshard.init_distributed
    assert not ds_comm.is_initialized() and ds_comm.is_available()
    assert (ds_comm.get_rank(), ds_comm.get_world_size(), ds_comm.get_local_rank()) == (0, 1, 0)
    assert ds_comm.get_global_rank() == 0 and ds_comm.get_all_ranks_from_group() == [0]
    t = torch.arange(4.0)
    assert ds_comm.all_reduce(t) is None and ds_comm.broadcast(t, 0) is None and ds_comm.barrier() is None
    torch.testing.assert_close(t, torch.arange(4.0), rtol=0, atol=0)  # the sum over one rank
    gathered = [torch.empty(4)]
    ds_comm.all_gather(gathered, t)
    out = torch.empty(4)
    ds_comm.all_gather_into_tensor(out, t)
    scattered = torch.empty(4)
    ds_comm.reduce_scatter_tensor(scattered, t)
    exchanged = torch.empty(4)
    ds_comm.all_to_all_single(exchanged, t)
    for got in (gathered[0], out, scattered, exchanged):
        torch.testing.assert_close(got, t, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="dist_init_required=False"):
        ds_comm.init_distributed(dist_init_required=False)


def test_a_zeroshard_group_of_one_is_answered_locally() -> None:
    alone = collectives.self_group(collectives.world_group())
    assert (ds_comm.get_rank(alone), ds_comm.get_world_size(alone)) == (0, 1)
    assert ds_comm.get_all_ranks_from_group(alone) == [0] and ds_comm.get_global_rank(alone, 0) == 0
    t = torch.ones(3)
    ds_comm.all_reduce(t, group=alone)
    torch.testing.assert_close(t, torch.ones(3), rtol=0, atol=0)


def test_local_rank_from_the_launcher(monkeypatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")  # DeepSpeed's fallback variable
    assert ds_comm.get_local_rank() == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert ds_comm.get_local_rank() == 2


def test_init_distributed_with_an_explicit_rendezvous(tmp_path) -> None:
    # In a fresh interpreter: the group it creates must not outlive the test, and it must be
    # freed at exit without the gloo abort ([Note: process-group lifetime]).
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import zeroshard.comm as dist
        dist.init_distributed("gloo", init_method="file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                              timeout=30)
        import torch.distributed as td
        assert dist.is_initialized() and td.get_world_size() == 1 and dist.get_rank() == 0
        print("ok", td.get_backend())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["ok", "gloo"]


def test_deepspeed_init_distributed_is_the_comm_one() -> None:
    assert zeroshard.init_distributed is zeroshard.comm.init_distributed  # as deepspeed.init_distributed
