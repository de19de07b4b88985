"""The simulated world (zeroshard/comm/simulated.py), in this process: rank 3 of 8.

Each collective's stand-in ("every peer is a replica of this rank"), subgroups and store calls
without any peer, the timed waits of a fabric on the CPU (a lane per group), and what a
simulated rank refuses to do."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from zeroshard.comm import collectives as comm
from zeroshard.comm import simulated
from zeroshard.comm.fabric import Fabric

W, R = 8, 3


@pytest.fixture
def sim():
    with simulated.world(W, R) as world:
        yield world
    assert not dist.is_initialized()


def test_world_is_torch_default_group(sim) -> None:
    assert (dist.get_world_size(), dist.get_rank()) == (W, R)
    assert dist.get_backend() == f"cpu:{simulated.BACKEND}"
    assert simulated.current() is sim and simulated.is_simulated()
    assert simulated.is_simulated(comm.world_group())
    # The engine's backend-dependent choices are gloo's on the CPU (NCCL's on CUDA).
    assert comm.backend_name(comm.world_group()) == "gloo"


def test_not_simulated_outside() -> None:
    assert simulated.current() is None and not simulated.is_simulated()
    simulated.refuse_in_simulation("save_checkpoint")  # nothing to refuse


def test_bad_world_arguments() -> None:
    with pytest.raises(ValueError, match=r"rank=8: must be in \[0, 8\)"):
        with simulated.world(8, 8):
            pass
    with pytest.raises(ValueError, match="device='tpu'"):
        with simulated.world(8, 0, device="tpu"):
            pass


def test_refuses_inside_an_existing_group(sim) -> None:
    with pytest.raises(RuntimeError, match="a process group already exists"):
        with simulated.world(2, 0):
            pass


def test_subgroups_need_no_peer(sim) -> None:
    members = tuple(range(4))
    group = comm.new_group(members, comm.world_group())
    assert (group.size, group.rank) == (4, R)
    assert simulated.is_simulated(group)
    assert dist.get_process_group_ranks(group.handle) == list(members)
    outsider = comm.new_group((4, 5), comm.world_group())
    assert outsider.rank == -1


def test_all_gather_fills_every_chunk_with_this_rank_input(sim) -> None:
    shard = torch.arange(5.0)
    full = torch.full((W * 5,), -1.0)
    comm.all_gather(full, shard, group=comm.world_group())
    assert torch.equal(full, shard.repeat(W))
    # In place, as FSDP2 gathers: the input is this rank's chunk of the output.
    full = torch.full((W * 5,), -1.0)
    full[R * 5 : (R + 1) * 5] = shard
    dist.all_gather_into_tensor(full, full[R * 5 : (R + 1) * 5])
    assert torch.equal(full, shard.repeat(W))


def test_sums_are_world_times_this_rank(sim) -> None:
    data = torch.arange(W * 3, dtype=torch.float32)
    out = torch.empty(3)
    comm.reduce_scatter(out, data.clone(), group=comm.world_group())
    assert torch.equal(out, W * data[R * 3 : (R + 1) * 3])
    t = torch.tensor([1.5, -2.0])
    comm.all_reduce(t, group=comm.world_group())
    assert torch.equal(t, torch.tensor([1.5 * W, -2.0 * W]))
    m = torch.tensor([1.5, -2.0])
    comm.all_reduce(m, group=comm.world_group(), op=dist.ReduceOp.MAX)
    assert torch.equal(m, torch.tensor([1.5, -2.0]))


def test_uneven_all_to_all_shapes_agree(sim) -> None:
    # A dropless exchange (zeroshard/moe/autoep/dispatch.py): counts first, then the rows they
    # announce. Every peer sends what this rank sends itself, so the counts received announce
    # exactly the rows the token exchange delivers.
    group = comm.world_group()
    send = torch.tensor([1, 0, 2, 4, 1, 0, 3, 2])  # rows to each rank; 4 to itself
    received = torch.empty_like(send)
    comm.all_to_all_single(received, send, group=group)
    assert received.tolist() == [4] * W
    rows = torch.arange(int(send.sum()) * 2, dtype=torch.float32).view(-1, 2)
    out = torch.empty(int(received.sum()), 2)
    comm.all_to_all_single(out, rows, received.tolist(), send.tolist(), group=group)
    own = rows[int(send[:R].sum()) : int(send[: R + 1].sum())]
    assert torch.equal(out, own.repeat(W, 1))
    # The way back (outputs sized by what this rank sent each peer): cut or zero-padded.
    back = torch.full((int(send.sum()), 2), -1.0)
    comm.all_to_all_single(back, out, send.tolist(), received.tolist(), group=group)
    assert torch.equal(back[:1], own[:1]) and torch.equal(back[1:1], own[:0])
    assert torch.equal(back[3:5], torch.cat([own[:2]]))  # rank 2's slice: 2 rows of the 4


def test_broadcast_barrier_objects_and_store(sim) -> None:
    t = torch.tensor([7.0])
    comm.broadcast(t, group=comm.world_group(), src=0)
    assert t.item() == 7.0
    dist.barrier()
    assert comm.all_gather_object({"rank": R}, group=comm.world_group()) == [{"rank": R}] * W
    store = dist.distributed_c10d._get_default_store()
    store.set("key", "value")
    assert store.get("key") == b"value" and store.add("count", 2) == 2


def test_fabric_time_on_the_cpu(sim) -> None:
    """The modelled time is a wait on the group's lane: at least the model's seconds, only at
    wait(), serial within a group and overlapped across groups. The model's time (T = 0.4 s) is
    long against the stand-in's copies and a loaded machine's scheduling delays, so the upper
    bounds keep a margin of 0.1-0.3 s."""
    modelled = 0.4
    # A 64 KB all-gather over 8 ranks on a fabric slow enough that it takes `modelled` seconds.
    sim.fabric = Fabric("slow", bus_gbps=64e3 * 7 / 8 / modelled / 1e9, latency_us=0.0)
    full, shard = torch.empty(16_000), torch.empty(2_000)
    start = time.perf_counter()
    handle = comm.all_gather(full, shard, group=comm.world_group(), async_op=True)
    issued = time.perf_counter() - start
    handle.wait()
    assert time.perf_counter() - start >= modelled > issued + 0.1, issued
    # Two collectives of one group queue behind each other; two groups' overlap.
    other = comm.new_group(tuple(range(W)), comm.world_group())
    start = time.perf_counter()
    a = comm.all_gather(full, shard, group=comm.world_group(), async_op=True)
    b = comm.all_gather(full, shard, group=comm.world_group(), async_op=True)
    a.wait(), b.wait()
    serial = time.perf_counter() - start
    start = time.perf_counter()
    a = comm.all_gather(full, shard, group=comm.world_group(), async_op=True)
    b = comm.all_gather(full, shard, group=other, async_op=True)
    a.wait(), b.wait()
    overlapped = time.perf_counter() - start
    assert serial >= 2 * modelled and modelled <= overlapped < 1.75 * modelled, (serial, overlapped)


def test_log_counts_every_collective(sim) -> None:
    sim.log = []
    comm.all_reduce(torch.ones(10), group=comm.world_group())
    dist.all_gather_into_tensor(torch.empty(W * 4), torch.ones(4))
    kinds = [(c.kind, c.group_size, c.nbytes) for c in sim.log]
    assert kinds == [("all_reduce", W, 40), ("all_gather", W, W * 16)]


def test_a_simulated_rank_writes_no_checkpoint(sim) -> None:
    with pytest.raises(simulated.SimulatedWorldError, match="rank 3 of a simulated 8-rank job"):
        simulated.refuse_in_simulation("save_checkpoint")
