"""Turns on co-located devices under StaleSync: the engines and the trainer share devices and the engines
sleep while the trainer works (`rollout.sleep_level` > 0), so the two cannot compute at once. The rollout
producer holds the devices while its engines generate; the trainer holds them from switching to training to
switching back (old and reference logprobs, the update, the weight sync). What runs on the host overlaps:
reward scoring and dynamic sampling of a batch with the trainer's turn, the next batch's prompts and the
driver's bookkeeping with either.

Turns are granted in the order asked (a ticket each), so neither side starves the other. A waiting side
calls `poll` every `poll_s` seconds: the trainer's thread serves engine recoveries there (an engine the
producer found dead is replaced by the trainer's thread while the producer holds its turn, waiting for it)
and raises if its peer failed.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable


class DeviceTurns:
    def __init__(self, poll_s: float = 5.0, on_turn: Callable[[str, float, float], None] | None = None):
        """`on_turn(side, start, seconds)` is called at the end of every turn (the run traces them)."""
        self._cond = threading.Condition()
        self._next_ticket = self._serving = 0
        self._done: set[int] = set()  # tickets finished or given up, not yet passed by `_serving`
        self.poll_s, self.on_turn = poll_s, on_turn
        self.holder: str | None = None
        self.turns: dict[str, int] = {}  # turns taken, per side
        self.wait_seconds: dict[str, float] = {}  # time spent waiting for a turn, per side

    @contextmanager
    def hold(self, side: str, poll: Callable[[], None] | None = None):
        """The devices for `side` ("rollout" or "training") while the block runs; `poll()` is called while
        waiting (it may raise, and the place in line is given up)."""
        t0 = time.time()
        with self._cond:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        try:
            while True:
                with self._cond:
                    if self._serving == ticket:
                        self.holder = side
                        self.turns[side] = self.turns.get(side, 0) + 1
                        self.wait_seconds[side] = self.wait_seconds.get(side, 0.0) + time.time() - t0
                        break
                    self._cond.wait(self.poll_s)
                if poll is not None:
                    poll()
        except BaseException:
            self._leave(ticket)
            raise
        start = time.time()
        try:
            yield
        finally:
            seconds = time.time() - start  # before the next side may start
            self._leave(ticket)
            if self.on_turn is not None:
                self.on_turn(side, start, seconds)

    def _leave(self, ticket: int) -> None:
        """Ticket `ticket` done (its turn over, or given up while waiting): the next in line goes."""
        with self._cond:
            self._done.add(ticket)
            if self._serving == ticket:
                self.holder = None
            while self._serving in self._done:
                self._done.discard(self._serving)
                self._serving += 1
            self._cond.notify_all()

    def take_wait_seconds(self) -> dict[str, float]:
        with self._cond:
            out, self.wait_seconds = self.wait_seconds, {}
            return out
