"""The distributed tests' process pool: `run_ranks` calls of the modules below reuse up to four processes
across the session instead of starting (and importing torch and the test module in) new ones per call,
which cost 4-8 s a call on 2 cores. A call that fails or hangs ends the pool's processes; the next starts
new ones. Modules whose ranks keep process-wide resources between calls (shared-memory segments of the
weight sync, vLLM engines) or that test a stalled peer run in processes of their own, as before."""

from __future__ import annotations

import pytest

from rlhf.parallel.launch import RankPool, using

POOLED = {"test_trainer", "test_routing_replay", "test_expert_migration", "test_checkpoint_resume", "test_on_policy"}


@pytest.fixture(scope="session")
def rank_pool():
    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _pooled_ranks(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in POOLED:
        yield
        return
    with using(request.getfixturevalue("rank_pool")):
        yield
