"""The pooled gloo harness itself: results per rank, failures, timeouts, recovery, hygiene.

The task functions below run inside the worker processes.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import DistPool, DistTaskError, DistTimeoutError, close_shared_pools

# ---- tasks (module level: workers import them by name) -------------------------------------


def rank_and_world() -> tuple[int, int, dict[str, str]]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return dist.get_rank(), dist.get_world_size(), {name: os.environ[name] for name in names}


def all_reduce_sum(value: float, *, scale: float = 1.0) -> torch.Tensor:
    tensor = torch.tensor([(dist.get_rank() + 1) * value * scale])
    dist.all_reduce(tensor)
    return tensor


def raise_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    dist.barrier()  # the other ranks wait here for a rank that never comes


def sleep_on_rank(sleepy_rank: int, seconds: float) -> int:
    if dist.get_rank() == sleepy_rank:
        time.sleep(seconds)
    return dist.get_rank()


def draw_and_leak() -> torch.Tensor:
    """A random draw, after checking that the previous task's environment did not leak."""
    assert "ZEROSHARD_TEST_LEAK" not in os.environ, "environment leaked from the previous task"
    os.environ["ZEROSHARD_TEST_LEAK"] = "1"
    torch.manual_seed(1234)  # must be undone before the next task
    return torch.rand(3)


def first_draw() -> torch.Tensor:
    return torch.rand(3)


def print_rank() -> None:
    print(f"hello from rank {dist.get_rank()}", flush=True)


def view_of_big_tensor() -> torch.Tensor:
    return torch.arange(1_000_000, dtype=torch.float32)[10:12]


def destroy_group() -> int:
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_one_result_per_rank(dist_pool, world_size: int) -> None:
    pool = dist_pool(world_size)
    results = pool.run(rank_and_world)
    assert [(rank, world) for rank, world, _ in results] == [(r, world_size) for r in range(world_size)]
    for rank, _, env in results:
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == str(world_size)
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == results[0][2]["MASTER_PORT"]

    # sum over ranks of (rank + 1) * 2 * 1.5 = 3 * W (W + 1) / 2, exact in fp32 at these sizes.
    sums = pool.run(all_reduce_sum, 2.0, scale=1.5)
    expected = torch.tensor([3.0 * world_size * (world_size + 1) / 2])
    for tensor in sums:
        assert torch.equal(tensor, expected)


def test_task_given_by_name(dist_pool) -> None:
    results = dist_pool(2).run("tests.dist.compat.test_harness:sleep_on_rank", 0, 0.0)
    assert results == [0, 1]


def test_state_is_reset_between_tasks(dist_pool) -> None:
    pool = dist_pool(2)
    torch.manual_seed(0)
    reference = torch.rand(3)
    first = pool.run(draw_and_leak)
    second = pool.run(draw_and_leak)  # fails if the environment variable survived
    assert torch.equal(first[0], second[0]) and torch.equal(first[0], first[1])
    for draw in pool.run(first_draw):  # seeded with 0 again, whatever the last task did
        assert torch.equal(draw, reference)


def test_worker_output_is_echoed_with_rank_prefix(dist_pool, capsys) -> None:
    dist_pool(2).run(print_rank)
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0\n" in out
    assert "[rank 1] hello from rank 1\n" in out


def test_returned_views_come_back_compact(dist_pool) -> None:
    (tensor,) = dist_pool(1).run(view_of_big_tensor)
    assert tensor.tolist() == [10.0, 11.0]
    assert tensor.untyped_storage().nbytes() == 8  # not the 4 MB storage it was a view of


def test_unpicklable_task_is_a_type_error(dist_pool) -> None:
    with pytest.raises(TypeError, match="picklable"):
        dist_pool(1).run(lambda: 0)


def test_failing_rank_reports_its_traceback_and_the_pool_recovers(dist_pool) -> None:
    pool = dist_pool(2)
    pool.run(rank_and_world)
    spawns = pool.spawn_count
    with pytest.raises(DistTaskError) as info:
        pool.run(raise_on_rank, 1)
    message = str(info.value)
    assert "task dist.test_harness:raise_on_rank" in message or "test_harness:raise_on_rank" in message
    assert "failed on rank(s) [1] (world size 2)" in message
    assert "--- rank 1 traceback ---\nTraceback (most recent call last):" in message
    assert 'raise ValueError(f"boom from rank {bad_rank}")' in message
    assert "ValueError: boom from rank 1" in message
    # Rank 0 is stuck in the barrier: reported, not waited for until gloo's own timeout.
    assert "rank(s) [0]: no reply" in message
    assert set(info.value.failures) == {1}
    assert not pool.alive

    results = pool.run(rank_and_world)
    assert [rank for rank, _, _ in results] == [0, 1]
    assert pool.spawn_count == spawns + 1


def test_timeout_is_reported_with_the_stuck_ranks_stack(dist_pool) -> None:
    pool = dist_pool(2)
    with pytest.raises(DistTimeoutError) as info:
        pool.run(sleep_on_rank, 1, 60.0, timeout=2.0)
    message = str(info.value)
    assert "timed out after 2.0 s on rank(s) [1] (world size 2); finished: [0]" in message
    assert "--- rank 1 stack at timeout ---" in message
    assert "in sleep_on_rank" in message  # faulthandler's frame line
    assert not pool.alive


def test_destroyed_process_group_means_fresh_workers_and_close_stops_them() -> None:
    with DistPool(1) as pool:
        assert pool.run(destroy_group) == [0]
        assert not pool.alive  # the task left no process group, so the workers were retired
        assert pool.run(rank_and_world)[0][:2] == (0, 1)
        assert pool.spawn_count == 2
        procs = list(pool._procs)
    assert procs and not any(p.is_alive() for p in procs)


def test_close_shared_pools_stops_workers_and_removes_their_files(dist_pool) -> None:
    pool = dist_pool(1)
    pool.run(rank_and_world)
    procs, workdir = list(pool._procs), pool._workdir
    assert workdir is not None and os.path.isdir(workdir)
    close_shared_pools()  # what the fixture does at session end; later users respawn
    assert not any(p.is_alive() for p in procs)
    assert not os.path.exists(workdir)
    assert dist_pool(1) is not pool
