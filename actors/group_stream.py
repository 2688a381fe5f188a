"""A draw's generation streamed back group by group (`Roles.stream`; streamed rollouts, docs/rollout.md).

The prompts are split over the engines as `Roles.generate` splits them, each share one Ray generator task
(`VLLMEngine.generate_stream`) yielding, after each decode step that finished some, the groups of the prompts
whose last sample it finished. The driver reads the groups as they come (`arrived`), scores and filters them
meanwhile, and `stop`s the engines once it has what it needs: every request still running is aborted at the
engine's next decode step.

Faults as in `Roles.generate`: an engine that dies, leaves a liveness probe unanswered for its `probe_s`, or
has not finished its share within the generate deadline (`rollout.hang_timeout_s`), is handed to
`roles.recover` (killed, replaced, given the weights the others serve), and the prompts of its share that had
not come back are generated there again with their own seeds, so the draw yields what it would have without
the fault. Without `recover` it raises RoleError.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

from actors.remote import RoleError, _unanswered_probes
from rlhf.data.sampler import prompt_seed

DRAIN_S = 60.0  # how long a stopped engine may take to abort its requests and end its task


class GroupStream:
    def __init__(self, roles, prompts: Sequence[Sequence[int]], n: int, seed: int, phase: str = "generate"):
        k = len(roles.engines)
        self.roles, self.prompts, self.n, self.seed = roles, prompts, n, seed
        self.chunks = [list(range(i, len(prompts), k)) for i in range(k)]
        self.got: list[set[int]] = [set() for _ in range(k)]  # prompts (indices into `prompts`) back from each
        self.streams: dict = {}  # engine -> (its handle, the Ray generator of its share)
        for e in range(k):
            if self.chunks[e]:
                h = roles.engines[e]
                seeds = [prompt_seed(seed, i) for i in self.chunks[e]]
                self.streams[e] = (h, h.actor.generate_stream.remote([prompts[i] for i in self.chunks[e]], n=n,
                                                                     seed=seeds))
        roles.inject(phase)  # chaos: kills as the phase's calls go out
        self.deadline = time.monotonic() + (roles.hang_timeout_s or roles.timeout_s)
        # liveness probes as `Roles.generate` sends them: an engine silent for its probe_s hangs
        self.every = min([h.probe_s for h, _ in self.streams.values() if h.probe_s > 0] or [math.inf])
        self.probes: dict = {}

    @property
    def done(self) -> bool:
        return not self.streams

    def arrived(self) -> list[tuple[int, list]]:
        """The groups that came back since the last call, as (prompt index, its n completions), waiting until
        at least one has or every share is done ([] then)."""
        out: list[tuple[int, list]] = []
        while self.streams and not out:
            tick = min(self.deadline, time.monotonic() + self.every)
            ready = self._ready(max(tick - time.monotonic(), 0.0))
            if not ready and time.monotonic() < self.deadline:  # a probe tick
                live = list(self.streams.items())
                stuck = _unanswered_probes([g for _, (_, g) in live], self.probes, [h for _, (h, _) in live])
                for e, (h, g) in live:
                    if any(g is x for x in stuck):
                        out += self._redo(e, RoleError(h.role, h.rank, "generate_stream", "hung: its process "
                                                       f"answered no liveness probe in {h.probe_s:.0f} s", hung=True))
                continue
            if not ready:
                e = next(iter(self.streams))
                h = self.streams[e][0]
                out += self._redo(e, RoleError(h.role, h.rank, "generate_stream", "did not finish within "
                                               f"{self.roles.hang_timeout_s or self.roles.timeout_s:.0f} s", hung=True))
                continue
            while ready:  # then whatever else is already there, without waiting
                for e in ready:
                    out += self._next(e)
                ready = self._ready(0.0) if self.streams else []
        return out

    def _ready(self, timeout: float) -> list[int]:
        """The engines whose stream has its next item (or its end) within `timeout` seconds: one at least, or
        none when the time is up; with 0, every one that has."""
        import ray

        engine = {id(g): e for e, (_, g) in self.streams.items()}
        ready, _ = ray.wait([g for _, g in self.streams.values()], num_returns=1 if timeout else len(engine),
                            timeout=timeout)
        return [engine[id(g)] for g in ready]

    def _next(self, e: int) -> list[tuple[int, list]]:
        h, gen = self.streams[e]
        try:
            ref = next(gen)
        except StopIteration:
            del self.streams[e]
            return []
        try:
            comps = h.wait("generate_stream", ref, 10.0)
        except RoleError as err:
            return self._redo(e, err)
        groups: dict[int, list] = {}  # the groups one decode step finished, by prompt index into `prompts`
        for c in comps:
            i = self.chunks[e][c.prompt_index]
            groups.setdefault(i, []).append(replace(c, prompt_index=i))
        self.got[e].update(groups)
        return list(groups.items())

    def _redo(self, e: int, err: RoleError) -> list[tuple[int, list]]:
        """Engine e failed: replaced (where the run recovers engines) and the rest of its share generated
        again there with the same seeds; otherwise `err` raised."""
        h, gen = self.streams.pop(e)
        if not (err.died or err.hung) or self.roles.recover is None:
            self._cancel(gen)
            self.stop()
            raise err
        self._cancel(gen)
        self.roles.recover([e], str(err), [h])
        missing = [i for i in self.chunks[e] if i not in self.got[e]]
        if not missing:
            return []
        comps = self.roles.generate([self.prompts[i] for i in missing], self.n, self.seed,
                                    seeds=[prompt_seed(self.seed, i) for i in missing])
        self.got[e].update(missing)
        groups: dict[int, list] = {}
        for c in comps:
            i = missing[c.prompt_index]
            groups.setdefault(i, []).append(replace(c, prompt_index=i))
        return sorted(groups.items())

    def stop(self) -> None:
        """Abort every share still generating and wait (at most DRAIN_S) for the engines' tasks to end, so the
        engines are free for the next call."""
        streams, self.streams = self.streams, {}
        for _, gen in streams.values():
            self._cancel(gen)
        end = time.monotonic() + DRAIN_S
        for _, gen in streams.values():
            _drain(gen, end)

    @staticmethod
    def _cancel(gen) -> None:
        import ray

        try:
            ray.cancel(gen)
        except Exception:
            pass


def _drain(gen, end: float) -> None:
    """Read (and drop) what a cancelled share still yields until its task ends, or until `end`."""
    import ray

    while True:
        ready, _ = ray.wait([gen], timeout=max(end - time.monotonic(), 0.0))
        if not ready:
            return
        try:
            ray.get(next(gen), timeout=max(end - time.monotonic(), 0.01))
        except StopIteration:
            return
        except Exception:  # the task's own end: cancelled (TaskCancelledError), or failed; nothing to keep
            return
