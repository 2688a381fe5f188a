"""Turns on co-located devices under StaleSync (`rlhf.driver.turns`): one side at a time, in the order asked,
a waiting side polled (and its place given up when the poll raises), a side that fails passes the turn on."""

import threading
import time

import pytest

from rlhf.driver.turns import DeviceTurns


def test_one_side_at_a_time_in_the_order_asked():
    spans = []
    turns, log, inside = DeviceTurns(poll_s=0.01, on_turn=lambda *a: spans.append(a)), [], []
    go = threading.Barrier(3)

    def side(name: str, n: int, pause: float):
        go.wait()
        for i in range(n):
            with turns.hold(name):
                inside.append(name)
                assert len(inside) == 1, inside  # never both
                log.append((name, i))
                time.sleep(pause)
                inside.remove(name)
            time.sleep(pause / 4)  # host work between turns (scoring, bookkeeping)

    threads = [threading.Thread(target=side, args=("rollout", 6, 0.01)),
               threading.Thread(target=side, args=("training", 6, 0.012))]
    for t in threads:
        t.start()
    go.wait()
    for t in threads:
        t.join(10)
    assert [i for n, i in log if n == "rollout"] == list(range(6))
    assert turns.turns == {"rollout": 6, "training": 6} and turns.holder is None
    # first come, first served: a side that asks while the other holds the devices goes next, so neither
    # side takes two turns in a row while the other is waiting
    names = [n for n, _ in log]
    assert sum(a == b for a, b in zip(names, names[1:])) <= 2, names
    # every turn reported (what the run traces), none overlapping the next
    spans.sort(key=lambda t: t[1])
    assert [side for side, _, _ in spans].count("training") == 6 and len(spans) == 12
    assert all(s0 + d0 <= s1 + 1e-6 for (_, s0, d0), (_, s1, _) in zip(spans, spans[1:]))


def test_a_waiting_side_is_polled_and_gives_up_its_place_when_the_poll_raises():
    turns, polls = DeviceTurns(poll_s=0.01), []
    held, release = threading.Event(), threading.Event()

    def holder():
        with turns.hold("rollout"):
            held.set()
            release.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)

    def poll():
        polls.append(time.time())
        if len(polls) == 3:
            raise RuntimeError("the producer failed")

    with pytest.raises(RuntimeError, match="the producer failed"):
        with turns.hold("training", poll):
            pytest.fail("got the turn while the other side held it")
    release.set()
    t.join(5)
    with turns.hold("training"):  # the place given up is skipped: the next in line goes at once
        assert turns.holder == "training"
    assert len(polls) == 3 and turns.turns == {"rollout": 1, "training": 1}


def test_a_side_that_fails_in_its_turn_passes_it_on():
    turns = DeviceTurns(poll_s=0.01)
    with pytest.raises(ValueError):
        with turns.hold("training"):
            raise ValueError("a trainer rank died")
    assert turns.holder is None
    done = threading.Event()
    t = threading.Thread(target=lambda: (turns.hold("rollout").__enter__(), done.set()))
    t.start()
    assert done.wait(5)
    waited = turns.take_wait_seconds()
    assert set(waited) == {"training", "rollout"} and turns.take_wait_seconds() == {}
