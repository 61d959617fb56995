"""The process harness itself: results by rank, errors named by rank, hangs fail."""

import time

import pytest
import torch
import torch.distributed as dist

from harness import DistributedTestError, run_distributed

pytestmark = pytest.mark.distributed


def _sum_ranks(rank, world_size, scale, *, offset=0):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world_size, "env_rank": dist.get_rank(),
            "sum": t.item() * scale + offset}


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from the test")
    return rank


def _skip_collective_on_rank0(rank, world_size):
    if rank != 0:  # rank 0 never joins: the others wait in the all_reduce
        dist.all_reduce(torch.ones(1))
    return rank


def _sleep_on_rank2(rank, world_size):
    if rank == 2:  # alive but never joins: the others hang in the all_reduce
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))
    return rank


def test_returns_results_ordered_by_rank():
    out = run_distributed(_sum_ranks, 4, 2.0, offset=1, timeout=60)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    assert all(o["env_rank"] == o["rank"] and o["world"] == 4 for o in out)
    assert all(o["sum"] == 6 * 2.0 + 1 for o in out)


def test_exception_is_reraised_with_rank_and_traceback():
    with pytest.raises(DistributedTestError) as ei:
        run_distributed(_raise_on_rank1, 4, timeout=60)
    msg = str(ei.value)
    assert msg.startswith("rank 1 failed")
    assert "ValueError: boom from the test" in msg and "_raise_on_rank1" in msg


@pytest.mark.parametrize("fn", [_skip_collective_on_rank0, _sleep_on_rank2])
def test_hang_fails_within_timeout(fn):
    t0 = time.monotonic()
    # A rank stuck in a collective may raise on gloo's group timeout before the deadline;
    # either way the run must fail, and fast.
    with pytest.raises((TimeoutError, DistributedTestError)) as ei:
        run_distributed(fn, 4, timeout=15)
    assert time.monotonic() - t0 < 30
    if isinstance(ei.value, TimeoutError):
        assert "did not finish within 15s" in str(ei.value)
