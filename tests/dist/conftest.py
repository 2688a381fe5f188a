"""The distributed tests' process pool: `run_ranks` calls of the modules below reuse up to four processes
instead of starting (and importing torch and the test module in) new ones per call (on 2 cores tests/dist took
7.6 min pooled against about 17 min before, `pytest tests/dist --durations=10`). A call that fails or hangs
ends the pool's processes; the next starts new ones. The pool ends after the last test of this directory (its
processes hold ~0.5 GB each). Modules whose ranks keep process-wide resources between calls (shared-memory
segments of the weight sync, vLLM engines) or that test a stalled peer run in processes of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhf.parallel.launch import RankPool, using

POOLED = {"test_trainer", "test_routing_replay", "test_expert_migration", "test_checkpoint_resume", "test_on_policy"}
HERE = Path(__file__).resolve().parent
_pool = RankPool(4)  # its processes start at the first pooled call


@pytest.fixture(autouse=True)
def _pooled_ranks(request):
    if request.module.__name__.rsplit(".", 1)[-1] not in POOLED:
        yield
        return
    with using(_pool):
        yield


def pytest_runtest_teardown(item, nextitem):
    if nextitem is None or Path(nextitem.path).resolve().parent != HERE:
        _pool.close()
