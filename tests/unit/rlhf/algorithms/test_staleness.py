"""StaleSync's bound: whatever order generation, completion and training interleave in, no step trains on a
sample more than `max_staleness` versions old, nothing is dropped or trained on twice, the queue never holds
more than the bound allows, and the run always finishes (the bound never deadlocks the two sides)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhf.algorithms.staleness import admissible, importance_stats, may_start, staleness, staleness_stats
from rlhf.data.versioned_queue import QueuedGroup, VersionedQueue


def _simulate(s: int, P: int, steps: int, rng: random.Random) -> dict:
    """A producer (one batch at a time, its P groups finishing one by one in random order, each on the weights
    the engines serve at that moment) and a trainer (take P groups, train, sync) on one VersionedQueue, with
    every enabled event picked at random."""
    q, served, next_batch, seq = VersionedQueue(), 0, 1, 0
    in_flight: list[int] = []  # groups of the batch being generated, not yet finished
    training: list[QueuedGroup] | None = None
    step, trained, max_queued = 1, [], 0
    while step <= steps:
        events = []
        if not in_flight and next_batch <= steps and may_start(next_batch, served, s):
            events.append("start")
        if in_flight:
            events.append("finish_group")
        if training is None and len(q) >= P:
            events.append("take")
        if training is not None:
            events.append("sync")
        assert events, f"deadlock at step {step}: served {served}, batch {next_batch}, queued {len(q)}"
        e = rng.choice(events)
        if e == "start":
            in_flight, next_batch = list(range(P)), next_batch + 1
        elif e == "finish_group":
            in_flight.pop(rng.randrange(len(in_flight)))
            q.put([QueuedGroup(seq, next_batch - 1, served, None)])
            seq += 1
        elif e == "take":
            training, dropped = q.take(P, step, s)
            assert dropped == 0
            if len(training) < P:  # not all admissible yet: put back and wait
                q.put(training)
                training = None
        else:
            trained.append([(g.seq, staleness(step, g.version)) for g in training])
            training, served, step = None, step, step + 1
        max_queued = max(max_queued, len(q) + len(in_flight))
    return {"trained": trained, "max_queued": max_queued, "dropped": q.dropped}


@settings(max_examples=300, deadline=None)
@given(s=st.integers(0, 3), P=st.integers(1, 4), steps=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_bound_holds_for_any_completion_order(s, P, steps, seed):
    out = _simulate(s, P, steps, random.Random(seed))
    ages = [age for step in out["trained"] for _, age in step]
    assert len(out["trained"]) == steps and all(0 <= a <= s for a in ages)
    seqs = [q for step in out["trained"] for q, _ in step]
    assert seqs == list(range(steps * P))  # every group trained on once, in the order it was made
    assert out["dropped"] == 0
    assert out["max_queued"] <= (s + 1) * P  # the back-pressure: at most s + 1 batches made ahead


def test_staleness_zero_is_the_synchronous_loop():
    """Batch b starts only when version b - 1 is served: generate, train, sync, one after another."""
    assert may_start(3, 2, 0) and not may_start(3, 1, 0)
    assert may_start(3, 1, 1) and not may_start(4, 1, 1)
    assert admissible(5, 4, 0) and not admissible(5, 3, 0) and admissible(5, 3, 1)
    assert not admissible(5, 5, 3)  # a sample from weights the step has not started from yet


def test_staleness_stats_count_each_age():
    st_ = staleness_stats(4, [3, 3, 2, 1])
    assert st_["stale/staleness_max"] == 2 and st_["stale/staleness_mean"] == pytest.approx(0.75)
    assert st_["stale/fresh_fraction"] == 0.5
    assert (st_["stale/samples_at_0"], st_["stale/samples_at_1"], st_["stale/samples_at_2"]) == (2, 1, 1)


def test_importance_stats_over_response_tokens_only():
    old = torch.log(torch.tensor([[0.5, 0.4, 0.9]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.1]]))
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = importance_stats(old, behaviour, mask, cap=2.0)
    assert out["stale/is_weight_max"] == pytest.approx(4.0)
    assert out["stale/is_weight_mean"] == pytest.approx(2.5)
    assert out["stale/is_truncated_fraction"] == pytest.approx(0.5)
