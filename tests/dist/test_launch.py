"""`run_ranks` on a `RankPool`: processes reused between calls with nothing a call changed process-wide
carried into the next, and a failed or hung call ending the pool so the next call starts from new processes."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from rlhf.parallel.launch import RankPool, run_ranks, using


def sum_ranks(rank):
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    os.environ["RLHF_TEST_LEFT_BEHIND"] = "1"  # what a call changes process-wide
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return t.item(), os.getpid()


def what_a_call_finds(rank):
    return "RLHF_TEST_LEFT_BEHIND" in os.environ, torch.get_default_dtype(), torch.is_grad_enabled(), os.getpid()


def rank_one_fails(rank):
    if rank == 1:
        raise ValueError("rank one fails")
    dist.barrier()  # rank 0 waits for a peer that never comes


def rank_one_hangs(rank):
    if rank == 1:
        time.sleep(600)
    return os.getpid()


def test_pooled_processes_are_reused_clean_and_replaced_after_a_failure_or_a_hang():
    pool = RankPool(2)
    try:
        with using(pool):
            first = run_ranks(sum_ranks, 2)
            assert [s for s, _ in first] == [3, 3]
            pids = [p for _, p in first]
            assert run_ranks(what_a_call_finds, 2) == [(False, torch.float32, True, pid) for pid in pids]
            assert [p for _, p in run_ranks(sum_ranks, 1)] == pids[:1]  # a smaller group on the same processes

            with pytest.raises(RuntimeError, match="rank 1 failed"):
                run_ranks(rank_one_fails, 2, collective_timeout_s=30)
            assert not pool.procs  # rank 0 was still waiting in its barrier: the pool ended at once
            after = [p for _, p in run_ranks(sum_ranks, 2)]
            assert not set(after) & set(pids)

            t0 = time.monotonic()
            with pytest.raises(TimeoutError, match=r"ranks \[1\] did not finish within 3 s"):
                run_ranks(rank_one_hangs, 2, timeout_s=3)
            assert time.monotonic() - t0 < 30 and not pool.procs
            assert not set(run_ranks(rank_one_hangs, 1)) & set(after)
    finally:
        pool.close()
    assert not pool.procs
