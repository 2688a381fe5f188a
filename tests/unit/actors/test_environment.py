"""Environment workers (`actors.environment`) as plain objects: a worker steps its episodes' environments and
refuses to start on a machine its environment says it cannot run on; the pool spreads episodes over workers and
brings a dead worker's episodes back as `lost`, starting a new worker on its slot."""

import pytest

from actors.environment import EnvironmentPool, EnvironmentWorker
from actors.remote import RoleError
from rlhf.data.prompts import PromptRow


class NoBox:
    stop = ()

    def check_machine(self):
        return "no kernel box here"

    def reset(self, row):
        pass

    def step(self, text):
        raise AssertionError("never stepped")


def test_a_worker_whose_environment_cannot_run_on_its_machine_refuses_to_start(monkeypatch):
    import sys
    import types

    monkeypatch.setitem(sys.modules, "nobox_env", types.SimpleNamespace(NoBox=NoBox))
    with pytest.raises(RuntimeError, match="nobox_env:NoBox cannot run on this worker's machine: no kernel box"):
        EnvironmentWorker("nobox_env:NoBox", {}, 5.0)


def test_a_worker_answers_its_episodes_steps():
    w = EnvironmentWorker("rlhf.agents.retry:Retry", {"feedback": " ?"}, 5.0)
    rows = [PromptRow("1+2=", "3", "t:0"), PromptRow("2+2=", "4", "t:1")]
    assert [o.kind for o in w.reset([4, 7], rows)] == ["ok", "ok"]
    outs = w.step([4, 7], ["3", "5"])
    assert outs[0].observation.done and outs[0].observation.reward == 1.0
    assert outs[1].observation.text == " ?" and not outs[1].observation.done


class Handle:
    """Stands in for a worker's RoleHandle: calls the worker object, or fails as a dead actor does."""

    def __init__(self, rank, dead=False):
        self.rank, self.dead, self.killed = rank, dead, False
        self.worker = EnvironmentWorker("rlhf.agents.retry:Retry", {}, 5.0)

    def kill(self, hung=False):
        self.killed = True


def test_the_pool_spreads_episodes_and_replaces_a_dead_worker(monkeypatch):
    import actors.environment as env_mod

    def call_each(calls, timeout_s, on_submit=None):
        on_submit()
        return [RoleError("environment", h.rank, m, "failed: the actor died", died=True) if h.dead
                else getattr(h.worker, m)(*args) for h, m, args, _ in calls]

    monkeypatch.setattr(env_mod, "call_each", call_each)
    started, phases = [], []
    workers = [Handle(0), Handle(1, dead=True)]
    dead = workers[1]
    pool = EnvironmentPool(workers, lambda i: started.append(i) or Handle(i), (), 5.0, log=lambda m: None,
                           inject=phases.append)
    rows = [PromptRow("1+2=", "3", f"t:{k}") for k in range(4)]
    outs = pool.reset([0, 1, 2, 3], rows)
    assert [o.kind for o in outs] == ["ok", "lost", "ok", "lost"]  # keys 1 and 3 live on worker 1
    assert started == [1] and pool.replaced == 1 and dead.killed and not pool.workers[1].dead
    assert phases == ["env_reset"]
    assert [o.kind for o in pool.reset([1, 3], rows[1::2])] == ["ok", "ok"]  # begun again on the new worker
    assert [o.observation.done for o in pool.step([0, 1, 2, 3], ["3", "3", "4", "3"])] == [True, True, False, True]


def test_a_worker_found_dead_by_two_batches_at_once_is_replaced_once(monkeypatch):
    """StaleSync's producer and an evaluation share the pool: both find worker 1 dead in calls sent to the same
    handle; one new worker takes the slot, and each batch's episodes there come back `lost`. Closing a batch
    drops only its own keys, on the workers that hold them."""
    import actors.environment as env_mod

    closed = []

    def call_each(calls, timeout_s, on_submit=None):
        if on_submit:
            on_submit()
        out = []
        for h, m, args, _ in calls:
            if m == "close":
                closed.append((h.rank, args[0]))
            out.append(RoleError("environment", h.rank, m, "failed: the actor died", died=True) if h.dead
                       else getattr(h.worker, m)(*args))
        return out

    monkeypatch.setattr(env_mod, "call_each", call_each)
    started = []
    workers = [Handle(0), Handle(1, dead=True)]
    dead = workers[1]
    pool = EnvironmentPool(workers, lambda i: started.append(i) or Handle(i), (), 5.0, log=lambda m: None)
    err = RoleError("environment", 1, "step", "failed: the actor died", died=True)
    pool._replace(1, dead, err)
    pool._replace(1, dead, err)  # the other thread's calls went to the same dead handle
    assert started == [1] and pool.replaced == 1 and pool.workers[1] is not dead
    rows = [PromptRow("1+2=", "3", f"t:{k}") for k in range(2)]
    pool.reset([10, 11], rows)
    pool.close([10, 11])
    assert closed == [(0, [10]), (1, [11])]
