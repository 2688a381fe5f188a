"""DistQueue: finished sample groups between the rollout producers and the trainer, in `queue_shards` Ray
actors (groups spread round robin by their sequence number). Each shard is a `rlhf.data.versioned_queue`;
the client below pushes, takes the oldest admissible groups over every shard, and saves / restores the
contents for checkpoints. How much is queued is bounded by the producers (`rlhf.algorithms.staleness.
may_start`), not by the queue: it refuses nothing, it only never hands out a group beyond the bound.
"""

from __future__ import annotations

from actors.remote import RoleHandle, call_all, spawn
from rlhf.data.versioned_queue import QueuedGroup, VersionedQueue


class DistQueueShard:
    """One shard (a plain class; a Ray actor where spawned)."""

    def __init__(self) -> None:
        self.q = VersionedQueue()

    def put(self, groups: list[QueuedGroup]) -> int:
        return self.q.put(groups)

    def heads(self, n: int, step: int, max_staleness: int) -> tuple[list[QueuedGroup], int]:
        """Take up to n admissible groups (the client puts back what it does not use)."""
        return self.q.take(n, step, max_staleness)

    def size(self) -> int:
        return len(self.q)

    def state(self) -> list[dict]:
        return self.q.state()

    def load(self, state: list[dict]) -> None:
        self.q.load(state)


class DistQueue:
    """The driver's handle on the shards; every call bounded by `timeout_s` (a dead shard is a RoleError)."""

    def __init__(self, shards: int, timeout_s: float = 60.0, name_prefix: str = ""):
        self.timeout_s = timeout_s
        self.shards: list[RoleHandle] = [spawn(DistQueueShard, "queue", i, num_cpus=0, name_prefix=name_prefix)
                                         for i in range(shards)]
        self.dropped = 0

    def _all(self, calls: list[tuple]) -> list:
        return call_all([(h, m, a, {}) for h, m, a in calls], self.timeout_s)

    def put(self, groups: list[QueuedGroup]) -> None:
        k = len(self.shards)
        by_shard = [[g for g in groups if g.seq % k == i] for i in range(k)]
        self._all([(h, "put", (part,)) for h, part in zip(self.shards, by_shard) if part])

    def take(self, n: int, step: int, max_staleness: int) -> tuple[list[QueuedGroup], int]:
        """The `n` oldest groups (by sequence number, over every shard) that step `step` may train on, and the
        number of groups dropped as too old. Fewer than n when fewer are queued."""
        replies = self._all([(h, "heads", (n, step, max_staleness)) for h in self.shards])
        got = sorted((g for taken, _ in replies for g in taken), key=lambda g: g.seq)
        dropped = sum(d for _, d in replies)
        self.dropped += dropped
        keep, back = got[:n], got[n:]
        if back:  # taken from a shard beyond the n oldest overall: returned where they came from
            self.put(back)
        return keep, dropped

    def size(self) -> int:
        return sum(self._all([(h, "size", ()) for h in self.shards]))

    def state(self) -> dict:
        groups = [g for part in self._all([(h, "state", ()) for h in self.shards]) for g in part]
        return {"groups": sorted(groups, key=lambda g: g["seq"]), "dropped": self.dropped}

    def load(self, state: dict) -> None:
        groups = [QueuedGroup.from_json(g) for g in state.get("groups", [])]
        k = len(self.shards)
        self._all([(h, "load", ([g.to_json() for g in groups if g.seq % k == i],)) for i, h in enumerate(self.shards)])
        self.dropped = int(state.get("dropped", 0))

    def close(self) -> None:
        for h in self.shards:
            try:
                h.kill()
            except Exception:
                pass
