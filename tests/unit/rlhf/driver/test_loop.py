"""The driver loop (`rlhf.driver.loop.drive`) with a rollout source and a run of our own, in-process: what a
source may rely on (when it starts, what runs inside its turn, when it must be quiet, when it stops) and what
the loop does on a trainer rank's death, whatever the source. The learning half of a step (`step.learn`,
which needs the roles) is replaced by a recorder of its calls; the real sources run end to end in
tests/e2e (test_rl_run, test_stale_sync)."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from actors.remote import RoleError
from rlhf.driver import loop
from rlhf.driver.sources import Collect
from rlhf.parity import Parity
from rlhf.schema import AlgorithmConfig


class FakeSource:
    """A rollout source that writes down what the loop asks of it."""

    phase, switches = "fake batch", True

    def __init__(self, events: list):
        self.events = events
        self.in_turn = self.quiet_now = False

    def wake(self):
        pass

    def start(self, run):
        self.events.append(("start", run.step))

    def batch(self, run, step):
        self.events.append(("batch", step))
        return SimpleNamespace(step=step)

    @contextmanager
    def turn(self, run, step):
        self.in_turn = True
        try:
            yield
        finally:
            self.in_turn = False

    def trained(self, run, step):
        assert self.in_turn
        self.events.append(("trained", step))

    @contextmanager
    def quiet(self):
        self.quiet_now = True
        yield
        self.quiet_now = False

    def state(self, d):
        return {}

    def measure(self, run, step, ro, learned):
        return Parity(0.0, 0.0, 0.0), {"fake/step": step}

    def stop(self, timeout_s, restarting=None):
        self.events.append(("stop", timeout_s, restarting is not None))

    def result(self):
        return {"fake": True}

    def close(self):
        self.events.append(("close",))


class FakeRun:
    """What the loop reads and calls of a `Run`, with checkpoints every `every` steps and a trainer rank that
    dies in the update of each step in `die_at` (once each)."""

    def __init__(self, source: FakeSource, steps=6, eval_every=3, every=2, die_at=(), fatal_at=None):
        self.cfg = SimpleNamespace(steps=steps, eval_every=eval_every)
        self.source, self.events, self.every = source, source.events, every
        self.die_at, self.fatal_at = set(die_at), fatal_at
        self.step = self.at_step = 0
        self.saved = 0
        self.roles = SimpleNamespace(timeout_s=30.0)
        self.faults = SimpleNamespace(dead_policy_rank=self._dead_rank, restart_policy=self._restart,
                                      close_recoveries=lambda: self.events.append(("close recoveries",)))
        self.recorded: list[tuple] = []

    def begin(self, step):
        self.at_step = step

    @contextmanager
    def phase(self, name, step):
        self.events.append(("phase", name, step))
        yield

    def evaluate(self, step):
        self.events.append(("evaluate", step, self.source.in_turn))
        return 0.5

    def checkpoint_due(self, step):
        return step % self.every == 0

    def checkpoint(self, step):
        assert self.source.quiet_now, "a checkpoint is written while the source is quiet"
        self.events.append(("checkpoint", step))
        self.saved = step

    def record(self, step, ro, learned, parity, acc, seconds, extra):
        self.step = step
        self.recorded.append((step, acc, extra["fake/step"], extra["learned/step"]))

    def finish(self, acc_start):
        self.events.append(("finish",))
        return {"steps_run": len(self.recorded)} | self.source.result()

    def close(self, failed=False):
        self.events.append(("close run", failed))

    def _dead_rank(self, e):
        return None if self.fatal_at == self.at_step else e

    def _restart(self, died):
        self.events.append(("restart", self.at_step, self.saved))
        self.step = self.saved


@pytest.fixture
def learn_calls(monkeypatch):
    calls = []

    def learn(run, ro, step, switch=True):
        assert run.source.in_turn and switch == run.source.switches
        calls.append(step)
        if step in run.die_at:
            run.die_at.discard(step)
            raise RoleError("trainer", 1, "update", "failed: the actor died", died=True)
        return SimpleNamespace(metrics={"learned/step": step}, batch=None)

    monkeypatch.setattr(loop, "learn", learn)
    return calls


def test_each_step_takes_its_batch_trains_and_evaluates_in_the_turn_and_saves_while_quiet(learn_calls):
    events = []
    run, source = FakeRun(FakeSource(events)), None
    source = run.source
    result = loop.drive(run, source)
    assert result == {"steps_run": 6, "fake": True}
    assert events[:2] == [("evaluate", 0, False), ("start", 0)]  # the first evaluation, then the source starts
    assert [e[1] for e in events if e[0] == "batch"] == [1, 2, 3, 4, 5, 6]
    assert [e for e in events if e[0] == "evaluate"][1:] == [("evaluate", 3, True), ("evaluate", 6, True)]
    assert [e[1] for e in events if e[0] == "checkpoint"] == [2, 4, 6]
    assert ("phase", "fake batch", 1) in events  # the batch is the step's phase named by the source
    # the source's metrics and the learning half's go to the record; the accuracy where evaluated
    assert run.recorded == [(s, 0.5 if s % 3 == 0 else None, s, s) for s in range(1, 7)]
    assert events[-3:] == [("close recoveries",), ("stop", 30.0, False), ("finish",)]


def test_a_dead_trainer_rank_restarts_from_the_checkpoint_and_the_source_starts_again(learn_calls):
    events = []
    run = FakeRun(FakeSource(events), die_at={5})
    result = loop.drive(run, run.source)
    assert result["steps_run"] == 6 and [r[0] for r in run.recorded] == [1, 2, 3, 4, 5, 6]
    i = events.index(("restart", 5, 4))
    assert events[i - 1] == ("stop", 30.0, True)  # stopped for the restart (a source that cannot, raises)
    assert events[i + 1] == ("start", 4)  # again from the checkpoint's step
    assert learn_calls == [1, 2, 3, 4, 5, 5, 6]  # step 5 redone


def test_a_restart_before_any_checkpoint_redoes_the_steps_since_the_start(learn_calls):
    events = []
    run = FakeRun(FakeSource(events), steps=3, every=10, die_at={3})
    loop.drive(run, run.source)
    assert learn_calls == [1, 2, 3, 1, 2, 3]


def test_a_failure_no_restart_mends_stops_the_source_and_the_run_and_is_raised(learn_calls):
    events = []
    run = FakeRun(FakeSource(events), die_at={2}, fatal_at=2)
    with pytest.raises(RoleError, match="actor died"):
        loop.drive(run, run.source)
    assert events[-3:] == [("close recoveries",), ("stop", 0, False), ("close run", True)]
    assert ("finish",) not in events


def test_train_closes_its_source_whatever_happens(monkeypatch):
    events = []
    source = FakeSource(events)

    def start(cfg, log, src):
        assert src is source
        raise RuntimeError("no Ray here")

    monkeypatch.setattr(loop.Run, "start", start)
    with pytest.raises(RuntimeError, match="no Ray here"):
        loop.train(SimpleNamespace(), source=source)
    assert events == [("close",)]


def test_the_synchronous_source_checks_parity_on_every_sample():
    """Collect's parity covers every response token (StaleSync's only the samples of the step's own weights), and
    the step logs the train-minus-rollout difference and the correction's shares."""
    old = torch.tensor([[0.0, -1.0, -2.0]])
    batch = SimpleNamespace(rollout_logp_BT=torch.tensor([[0.0, -1.5, -2.0]]), mask_BT=torch.tensor([[0.0, 1.0, 1.0]]))
    run = SimpleNamespace(cfg=SimpleNamespace(algorithm=AlgorithmConfig(tis_cap=1.5)))
    parity, extra = Collect().measure(run, 1, None, SimpleNamespace(old_logp=old, batch=batch))
    assert parity.max_abs_diff == pytest.approx(0.5)
    assert extra["correction/logp_diff_mean"] == pytest.approx(0.25)
    assert extra["correction/token_clipped_fraction"] == pytest.approx(0.5)  # exp(0.5) = 1.65 > 1.5
    assert Collect().result() == {"samples_dropped": 0}
