"""One DistQueue shard's content: oldest first, only what the step may train on, older groups dropped and
counted, later versions kept for later steps, nothing queued twice, and a checkpoint round trip loses nothing."""

import json

import pytest

from rlhf.data.versioned_queue import QueuedGroup, VersionedQueue


def _g(seq, version, batch=1):
    return QueuedGroup(seq, batch, version, {"seq": seq})


def test_take_oldest_within_the_bound_and_drop_older():
    q = VersionedQueue()
    q.put([_g(3, 4), _g(0, 1), _g(2, 3), _g(1, 2), _g(4, 5)])  # any order in, made order out
    got, dropped = q.take(2, step=5, max_staleness=1)  # admissible versions: 3 and 4
    assert [g.seq for g in got] == [2, 3]
    assert dropped == 2 and q.dropped == 2  # versions 1 and 2 are beyond the bound
    assert [g.seq for g in q.take(5, step=6, max_staleness=1)[0]] == [4]  # version 5 waited for step 6
    assert len(q) == 0


def test_take_at_most_n_and_keep_the_rest():
    q = VersionedQueue()
    q.put([_g(i, 0) for i in range(5)])
    got, _ = q.take(3, step=1, max_staleness=0)
    assert [g.seq for g in got] == [0, 1, 2] and len(q) == 2


def test_a_group_is_never_queued_twice():
    q = VersionedQueue()
    q.put([_g(0, 0)])
    with pytest.raises(ValueError, match="group 0 .* already queued"):
        q.put([_g(0, 0)])


def test_state_round_trip_through_json():
    q = VersionedQueue()
    q.put([_g(i, i % 2, batch=i // 2) for i in range(4)])
    again = VersionedQueue()
    again.load(json.loads(json.dumps(q.state())))
    assert again.take(10, step=2, max_staleness=1)[0] == q.take(10, step=2, max_staleness=1)[0]
