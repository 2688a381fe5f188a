"""Spawning role classes as Ray actors, and calling them with a deadline.

Role classes are plain Python classes (testable without Ray); they become actors here. Every remote
call goes through `call`, which waits at most `timeout_s` and turns a worker exception or a timeout
into a `RoleError` naming the role and rank, so the driver never hangs on a dead or stuck actor.
"""

from __future__ import annotations

import socket
from typing import Any, Callable


class RoleError(RuntimeError):
    """A remote call to a role failed or timed out; names the role, rank and method."""

    def __init__(self, role: str, rank: int, method: str, why: str, died: bool = False, hung: bool = False):
        super().__init__(f"{role} rank {rank}: {method} {why}")
        self.role, self.rank, self.method = role, rank, method
        self.pending: list = []  # from call_all: the calls of the other ranks, still running
        self.died = died  # the actor's process is gone (not: it raised, or it did not answer in time)
        self.hung = hung  # it did not answer in time


def sigkill_if_here(actor) -> bool:
    """SIGKILL to the actor's process if it is alive on this node, as the GCS knows it (its pid and node: a pid of
    another node, or of an actor already dead and perhaps reused, is left alone). Ray's state table is a private
    API: where it is missing or changed, nothing is done (Ray's own kill still follows, 5 s later for a hung
    process). Whether a signal was sent."""
    import os
    import signal

    import ray

    try:
        from ray._private import state

        info = state.actors(actor._actor_id.hex())
        if info.get("State") != "ALIVE" or info["Address"]["NodeID"] != ray.get_runtime_context().get_node_id():
            return False
        os.kill(int(info["Pid"]), signal.SIGKILL)
        return True
    except Exception:
        return False


PROBE_GROUP = "probe"  # the concurrency group of liveness probes: answered while the actor's own calls run


class RoleHandle:
    """An actor plus the role and rank it plays, for error messages. `probe_s` > 0: the actor answers liveness
    probes (its `pid`) on a thread of their own (`spawn(probe_s=...)`), so a process that answers none for
    `probe_s` seconds while a call runs is hung, not busy."""

    def __init__(self, actor, role: str, rank: int, probe_s: float = 0.0):
        self.actor, self.role, self.rank, self.probe_s = actor, role, rank, probe_s

    def kill(self, hung: bool = False) -> None:
        """Kill the actor now. After `ray.shutdown()` it went with the instance: nothing to do (`ray.kill` would
        first start a new local instance, dashboard included, then fail on the old handle: the async main job
        started a second Ray instance at its end for its queue's shards).

        `hung` (its process may answer nothing: stopped, wedged): where it runs on this node it is sent SIGKILL
        first. Ray's kill asks the process to exit and kills it only `kill_worker_timeout_milliseconds` (5 s) later
        if it has not: a hung process held its placement slot, and its replacement waited, that much longer."""
        import ray

        if not ray.is_initialized():
            return
        if hung:
            sigkill_if_here(self.actor)
        ray.kill(self.actor, no_restart=True)

    def submit(self, method: str, *args, _num_returns: int = 1, **kwargs):
        """The call's object reference; with `_num_returns` > 1, the list of its references."""
        m = getattr(self.actor, method)
        return (m if _num_returns == 1 else m.options(num_returns=_num_returns)).remote(*args, **kwargs)

    def probe(self):
        """A liveness probe's reference (its answer: the pid), on the probe thread (probed actors only)."""
        return self.actor.pid.options(concurrency_group=PROBE_GROUP).remote()

    def call(self, method: str, *args, timeout_s: float = 300.0, **kwargs) -> Any:
        return self.wait(method, self.submit(method, *args, **kwargs), timeout_s)

    def wait(self, method: str, ref, timeout_s: float) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            try:
                ray.cancel(ref)  # best effort; a stuck actor is killed and replaced by its owner (`kill`)
            except Exception:
                pass
            raise RoleError(self.role, self.rank, method, f"did not answer within {timeout_s:.0f} s",
                            hung=True) from None
        except ray.exceptions.RayActorError as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            if getattr(e, "actor_init_failed", False) and lines:  # the constructor raised: its last line says why
                why = f"failed: the actor could not start ({lines[-1]})"
            else:
                why = f"failed: the actor died ({lines[0] if lines else type(e).__name__})"
            raise RoleError(self.role, self.rank, method, why, died=True) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            raise RoleError(self.role, self.rank, method, f"raised {type(cause).__name__}: "
                            f"{str(cause).splitlines()[0] if str(cause) else ''}") from cause


def call_all(calls: list[tuple[RoleHandle, str, tuple, dict]], timeout_s: float = 300.0,
             on_submit: Callable[[], None] | None = None, probe: bool = False, submitted: list | None = None) -> list[Any]:
    """Start every (handle, method, args, kwargs) call at once, then wait for all under one deadline:
    collective methods (every rank of a group must enter them) never wait on a rank not yet called.
    Results are read as they complete, so the first rank that fails raises RoleError (naming its role
    and rank) at once, not after its peers, stuck in a collective with it, time out. `on_submit` runs
    once every call is out (fault injection). `probe`: each probed actor (`RoleHandle.probe_s`) is probed as its
    call goes out and then every `probe_s` seconds while it runs, and one that has not answered the previous
    probe fails its call at once as hung (RoleError.hung), long before the deadline. Only calls to actors already up:
    an actor still in its constructor answers no probe. `submitted`: the calls' references, sent earlier
    (the deadline counts from now)."""
    return _gather(calls, timeout_s, on_submit, first_error=True, probe=probe, submitted=submitted)


def call_each(calls: list[tuple[RoleHandle, str, tuple, dict]], timeout_s: float = 300.0,
              on_submit: Callable[[], None] | None = None, probe: bool = False) -> list[Any]:
    """As `call_all`, but every call is waited for: each result, or the RoleError its call ended in (the
    caller decides what a failed call means; independent calls, never collective ones)."""
    return _gather(calls, timeout_s, on_submit, first_error=False, probe=probe)


def _gather(calls, timeout_s: float, on_submit, first_error: bool, probe: bool = False,
            submitted: list | None = None) -> list[Any]:
    import math
    import time

    import ray

    subs = [h.submit(m, *a, **kw) for h, m, a, kw in calls] if submitted is None else submitted
    refs = [s[0] if isinstance(s, list) else s for s in subs]  # several returns: waited on by the first
    if on_submit is not None:
        on_submit()
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    probes: dict = {}  # a running call's reference -> (the last probe of its actor, when it was sent)
    every = min([h.probe_s for h, *_ in calls if h.probe_s > 0] or [math.inf]) if probe else math.inf
    if every < math.inf:  # the first probes go out with the calls: a process already stopped is found in one interval
        _unanswered_probes(pending, probes, [calls[index[r]][0] for r in pending])
    tick = time.monotonic() + every
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(min(deadline, tick) - time.monotonic(), 0.0))
        if not ready and time.monotonic() < deadline:  # a probe tick
            tick = time.monotonic() + every
            for ref in _unanswered_probes(pending, probes, [calls[index[r]][0] for r in pending]):
                pending.remove(ref)
                h, m = calls[index[ref]][:2]
                error = RoleError(h.role, h.rank, m, f"hung: its process answered no liveness probe in "
                                  f"{h.probe_s:.0f} s", hung=True)
                if first_error:
                    error.pending = pending
                    raise error
                results[index[ref]] = error
            continue
        if not ready:  # the deadline passed: report the first call still running
            h, m = calls[index[pending[0]]][:2]
            for ref in pending:
                try:
                    ray.cancel(ref)
                except Exception:
                    pass
            error = RoleError(h.role, h.rank, m, f"did not answer within {timeout_s:.0f} s", hung=True)
            if first_error:
                raise error
            for ref in pending:
                i = index[ref]
                results[i] = RoleError(calls[i][0].role, calls[i][0].rank, calls[i][1],
                                       f"did not answer within {timeout_s:.0f} s", hung=True)
            break
        i = index[ready[0]]
        try:
            results[i] = calls[i][0].wait(calls[i][1], ready[0], 0.01)
            if isinstance(subs[i], list):  # (the first return's value, the other returns' references)
                results[i] = (results[i], subs[i][1:])
        except RoleError as e:
            if first_error:
                e.pending = pending  # the peers' calls, for a caller that recovers to wait out (`settle`)
                raise
            results[i] = e
    return results


def _unanswered_probes(pending: list, probes: dict, handles: list[RoleHandle]) -> list:
    """The running calls whose actor has left a probe unanswered for its `probe_s`; a new probe to every other
    probed actor whose last one was answered. A probe that fails (the actor died) counts as answered: the call
    itself reports it."""
    import time

    import ray

    stuck, now = [], time.monotonic()
    for ref, h in zip(pending, handles):
        if h.probe_s <= 0:
            continue
        last, sent = probes.get(ref, (None, now))
        if last is not None and ray.wait([last], timeout=0)[0]:
            last = None
        if last is None:
            probes[ref] = (h.probe(), now)
        elif now - sent >= h.probe_s * 0.999:
            stuck.append(ref)
    return stuck


def settle(refs, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) for calls whose results no longer matter, their errors read and dropped: a
    caller recovering from one rank's failure lets its peers' calls end first (and Ray does not report their
    errors as unhandled)."""
    import ray

    if not refs:
        return
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:
            pass


def spawn(cls, role: str, rank: int, *args, num_cpus: float = 1, num_gpus: float = 0, resources: dict | None = None,
          placement_group=None, bundle_index: int | None = None, name_prefix: str = "", max_concurrency: int = 1,
          probe_s: float = 0.0, env: dict[str, str] | None = None, **kwargs) -> RoleHandle:
    """Start `cls(*args, **kwargs)` as a Ray actor (in a placement-group bundle when given). `max_concurrency`
    > 1: calls run on that many threads (the class synchronises them itself). `probe_s` > 0: liveness probes
    (its `pid` method) are answered on a thread of their own, beside the running call (`RoleHandle.probe`),
    and one unanswered for `probe_s` seconds means the actor hangs. `env`: variables the actor's process starts with
    (Ray's runtime_env; for what a process reads only at its start)."""
    import ray

    options: dict = {"num_cpus": num_cpus, "name": f"{name_prefix}{role}-{rank}", "max_restarts": 0}
    if max_concurrency > 1:
        options["max_concurrency"] = max_concurrency
    if num_gpus:
        options["num_gpus"] = num_gpus
    if resources:
        options["resources"] = resources
    if env:
        options["runtime_env"] = {"env_vars": dict(env)}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index)
    remote_cls = ray.remote(concurrency_groups={PROBE_GROUP: 1})(cls) if probe_s > 0 else ray.remote(cls)
    actor = remote_cls.options(**options).remote(*args, **kwargs)
    return RoleHandle(actor, role, rank, probe_s=probe_s)


def node_address(local: bool = False) -> tuple[str, int]:
    """The address rank 0 of a group hosts the group's store on, and a free TCP port there: 127.0.0.1 for a
    `local` run (every role on one node: the groups listen on loopback alone, weight_sync.store), else this
    node's address."""
    host = "127.0.0.1"
    if not local:
        try:
            import ray

            host = ray.util.get_node_ip_address()
        except Exception:
            pass
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]
