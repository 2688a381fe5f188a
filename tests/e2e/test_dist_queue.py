"""DistQueue over several shard actors (real Ray actors, no vLLM): the client hands out the oldest groups
over all shards in the order they were made, puts back what it took beyond the n oldest, drops and counts
groups beyond the bound, and its saved state restores into a different number of shards unchanged."""

import json

from actors.dist_queue import DistQueue
from rlhf.data.versioned_queue import QueuedGroup


def _g(seq, version):
    return QueuedGroup(seq, seq // 4 + 1, version, {"seq": seq, "text": f"group {seq}"})


def test_oldest_first_over_shards_with_drops_and_restore(ray_session):
    q = DistQueue(shards=2, name_prefix="dq-test-")
    try:
        q.put([_g(s, v) for s, v in [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2), (6, 3), (7, 3)]])
        assert q.size() == 8
        got, dropped = q.take(3, step=3, max_staleness=1)  # step 3 trains on versions 1 and 2
        assert [g.seq for g in got] == [2, 3, 4] and dropped == 2 and q.dropped == 2
        assert q.size() == 3  # 5 (version 2) was taken by its shard beyond the 3 oldest and put back; 6, 7 wait
        state = json.loads(json.dumps(q.state()))
        assert [g["seq"] for g in state["groups"]] == [5, 6, 7] and state["dropped"] == 2
        again = DistQueue(shards=3, name_prefix="dq-test-again-")
        try:
            again.load(state)
            assert again.dropped == 2
            got, dropped = again.take(10, step=4, max_staleness=1)
            assert [(g.seq, g.payload["text"]) for g in got] == [(5, "group 5"), (6, "group 6"), (7, "group 7")]
            assert dropped == 0 and again.size() == 0
        finally:
            again.close()
    finally:
        q.close()


SHUT_THEN_CLOSE = """
import ray
from actors.dist_queue import DistQueue

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
q = DistQueue(shards=1, name_prefix="dq-shut-")
assert q.size() == 0  # the shard is up
ray.shutdown()  # as a run that owns its Ray instance ends: the shards went with it
q.close()
print("initialized after close:", ray.is_initialized())
"""


def test_closing_after_the_instance_ended_starts_no_new_instance():
    """A queue closed after its run shut its own Ray instance down (the async loop closes the queue last) must
    not start a second instance to kill actors that are gone: `ray.kill` of an old handle starts one, dashboard
    included (5-10 s at the end of every async run, and a directory left in /tmp), then fails."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SHUT_THEN_CLOSE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "initialized after close: False" in r.stdout
    assert r.stderr.count("Started a local Ray instance") == 1, r.stderr[-3000:]
