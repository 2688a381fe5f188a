"""The content of one DistQueue shard, pure: finished groups in the order they were made, each with the
weight version that made it; taken oldest first within the staleness bound, older ones dropped and counted.
The Ray actor around it is `actors.dist_queue`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from rlhf.algorithms.staleness import admissible


@dataclass(frozen=True)
class QueuedGroup:
    seq: int  # the order groups were made in (unique over a run)
    batch: int  # the batch it was made for
    version: int  # the oldest weights among its samples
    payload: Any  # the group itself (JSON-able: it goes into checkpoints)

    def to_json(self) -> dict:
        return {"seq": self.seq, "batch": self.batch, "version": self.version, "payload": self.payload}

    @staticmethod
    def from_json(d: dict) -> "QueuedGroup":
        return QueuedGroup(int(d["seq"]), int(d["batch"]), int(d["version"]), d["payload"])


class VersionedQueue:
    def __init__(self) -> None:
        self._items: list[QueuedGroup] = []  # ordered by seq
        self.dropped = 0  # groups found beyond the staleness bound

    def __len__(self) -> int:
        return len(self._items)

    def put(self, groups: list[QueuedGroup]) -> int:
        """Add groups (any order; a seq already held is refused, so nothing is queued twice). The new size."""
        held = {g.seq for g in self._items}
        for g in groups:
            if g.seq in held:
                raise ValueError(f"group {g.seq} (batch {g.batch}) is already queued")
            held.add(g.seq)
            bisect.insort(self._items, g, key=lambda x: x.seq)
        return len(self._items)

    def take(self, n: int, step: int, max_staleness: int) -> tuple[list[QueuedGroup], int]:
        """Up to `n` of the oldest groups step `step` may train on, removed; groups older than the bound are
        removed too and counted (returned, and summed in `dropped`). Groups of later versions stay."""
        out, dropped, keep = [], 0, []
        for g in self._items:
            if len(out) < n and admissible(step, g.version, max_staleness):
                out.append(g)
            elif g.version < step - 1 - max_staleness:
                dropped += 1
            else:
                keep.append(g)
        self._items = keep
        self.dropped += dropped
        return out, dropped

    def state(self) -> list[dict]:
        return [g.to_json() for g in self._items]

    def load(self, state: list[dict]) -> None:
        self._items = []
        self.put([QueuedGroup.from_json(d) for d in state])
