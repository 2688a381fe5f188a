"""Arithmetic with feedback: a wrong answer is told so and the model tries again.

The tiny world's multi-turn task, in its own alphabet: a model turn is an answer, scored by the arithmetic
task's rule (`rlhf.data.arithmetic.is_correct`); a wrong one is answered with `feedback` (appended as its own
tokens) and the model gets another turn, up to `agent.max_turns`; a right one ends the episode with reward
`decay ** (tries - 1)` (1.0: a late right answer counts as much as a first one).
"""

from __future__ import annotations

from rlhf.agents.environment import Observation
from rlhf.data.arithmetic import is_correct


class Retry:
    stop: tuple[str, ...] = ()  # a turn is one answer, ended by EOS

    def __init__(self, feedback: str = " ?", decay: float = 1.0):
        if not feedback or not 0 < decay <= 1:
            raise ValueError("Retry: feedback must be non-empty text and decay in (0, 1]")
        self.feedback, self.decay = feedback, decay
        self.answer, self.tries = "", 0

    def reset(self, row) -> None:
        self.answer, self.tries = row.answer, 0

    def step(self, text: str) -> Observation:
        self.tries += 1
        if is_correct(text, self.answer):
            return Observation(done=True, reward=self.decay ** (self.tries - 1))
        return Observation(text=self.feedback)
